"""A group's ranks meet on rank 0's TCPStore (drafter.rendezvous=tcp): no directory shared.

Real processes (spawn), each hosting its own store as a rank does from its start, and gloo over
loopback. Versions on one store stay apart (each under its own key prefix); a rank 0 that dies
while the others wait at the rendezvous fails their wait at once, not after its timeout; a rank 0
whose store is not there is waited for until the version ends or the rendezvous' bound is spent.
A rank's store binds its address on the route to the dispatcher, and gloo that address's interface.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time

import pytest
from common.run.config import ConfigError, load_config
from common.wire.store_names import tcp_store_name
from drafter_worker.process_group import RendezvousIncomplete, StepGroup, VersionEnded
from drafter_worker.rendezvous import GLOO_IFNAME_ENV, RendezvousServer, address_towards, interface_of
from hsd_testing import child_message, free_port, started
from rendezvous_ranks import TIMEOUT_S, rank_main

CONNECTION_LOST = re.compile(r"connection reset|connection closed|connection was likely closed|broken pipe|closed by peer",
                             re.IGNORECASE)


def test_ranks_meet_on_rank_0s_store_versions_stay_apart_and_a_dead_rank_0_fails_the_wait_at_once():
    ctx = mp.get_context("spawn")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=rank_main, args=(rank, *queues[rank])) for rank in range(2)]
    with started(procs):
        addresses = [child_message(out, p) for (out, _), p in zip(queues, procs)]
        assert addresses[0] != addresses[1] and addresses[0].startswith("127.0.0.1:")
        for _, orders in queues:
            orders.put(addresses[0])
        assert [child_message(out, p) for (out, _), p in zip(queues, procs)] == [3.0, 3.0]
        assert child_message(queues[0][0], procs[0]) == 1  # only itself came to version 2
        for _, orders in queues:
            orders.put("on")
        assert [child_message(out, p) for (out, _), p in zip(queues, procs)] == ["waiting", "waiting"]
        procs[0].kill()  # SIGKILL: no goodbye on the store's connections
        kind, _, message = child_message(queues[1][0], procs[1])
        # the closed connection to rank 0's store, not the wait's bound and not the dispatcher
        assert kind == "CollectiveFailed" and CONNECTION_LOST.search(message), (kind, message)
        assert not re.search(r"time ?out|timed out", message, re.IGNORECASE), message
        procs[1].join(timeout=60)
        assert procs[1].exitcode == 0


def test_a_rank_0_whose_store_is_not_there_is_waited_for_until_the_version_ends_or_the_bound():
    nobody = f"127.0.0.1:{free_port()}"
    asked = []

    def still_current() -> bool:
        asked.append(time.monotonic())
        return len(asked) < 3

    with pytest.raises(VersionEnded):  # the version's end, asked of still_current, not the bound (an error of its own)
        StepGroup(store=tcp_store_name(nobody, "m/i0-v1"), rank=1, world_size=2, version=1, timeout_s=TIMEOUT_S,
                  max_jobs=1, still_current=still_current)
    assert len(asked) == 3
    with pytest.raises(RendezvousIncomplete, match="rank 0's store at 127.0.0.1:.* did not answer") as info:
        StepGroup(store=tcp_store_name(nobody, "m/i0-v2"), rank=1, world_size=2, version=2, timeout_s=TIMEOUT_S,
                  max_jobs=1, rendezvous_timeout_s=0.5)
    assert info.value.arrived == 1



def test_a_rank_binds_its_store_to_its_address_towards_the_dispatcher_and_gloo_to_that_interface(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)
    assert address_towards("ipc:///runs/x/control.sock") == "127.0.0.1"
    assert address_towards(f"tcp://127.0.0.1:{free_port()}") == "127.0.0.1"  # (nothing is sent)
    config = load_config(None, ["drafter.rendezvous=tcp"])
    server = RendezvousServer.for_rank(config.drafter, control_endpoint=config.control_endpoint)
    assert server.host == "127.0.0.1" and server.address == f"127.0.0.1:{server.port}" and server.port > 0
    assert os.environ[GLOO_IFNAME_ENV] == interface_of("127.0.0.1") is not None
    with pytest.raises(ConfigError, match="drafter.rendezvous_host: cannot bind"):
        RendezvousServer("192.0.2.1", timeout_s=1.0)  # TEST-NET-1: an address of no host here
    with pytest.raises(ConfigError, match="drafter.rendezvous_host: no address of this host on the route"):
        address_towards("tcp://no-such-host.invalid:5555")
