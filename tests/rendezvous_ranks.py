"""The ranks of tests/drafter_worker/test_rendezvous.py: a module importable by name, so a spawned
child process can find its entry point.

Each rank hosts its own TCPStore, as a drafter does from its start, and tells the test its address;
the test tells every rank rank 0's, and what follows is :func:`rank_main`'s script.
"""

from __future__ import annotations

import time

import torch

from common.wire.store_names import tcp_store_name
from drafter_worker.process_group import CollectiveFailed, RendezvousIncomplete, StepGroup
from drafter_worker.rendezvous import RendezvousServer

TIMEOUT_S = 60.0  # every collective's and rendezvous' bound here: what a failure must not wait out


def rank_main(rank: int, out, orders) -> None:
    """Version 1: both ranks sum a tensor. Version 2: rank 0 alone, which must not count version 1's
    arrivals. Version 3 (3 ranks): both wait for a rank 2 that never comes, until the test kills
    rank 0; rank 1 says how its wait ended, and when."""
    server = RendezvousServer("127.0.0.1", timeout_s=TIMEOUT_S)
    out.put(server.address)
    rank0 = orders.get()

    def group(version: int, world_size: int, **kwargs) -> StepGroup:
        return StepGroup(store=tcp_store_name(rank0, f"m/i0-v{version}"), server=server, rank=rank,
                         world_size=world_size, version=version, timeout_s=TIMEOUT_S, max_jobs=1, **kwargs)

    g = group(1, 2)
    total = torch.tensor([float(rank + 1)])
    g.all_reduce(total)
    g.close()
    out.put(total.item())
    if rank == 0:  # alone at version 2: version 1's arrivals, on the same store, do not count
        try:
            group(2, 2, rendezvous_timeout_s=1.0)
        except RendezvousIncomplete as exc:
            out.put(exc.arrived)
    orders.get()

    def waiting() -> bool:  # asked every 0.25 s at the rendezvous: the version stands
        if not getattr(waiting, "said", False):
            waiting.said = True
            out.put("waiting")
        return True

    try:  # version 3 waits for a rank 2 that never comes; the test kills rank 0 meanwhile
        group(3, 3, still_current=waiting)
    except CollectiveFailed as exc:
        out.put((type(exc).__name__, time.monotonic(), str(exc)))
