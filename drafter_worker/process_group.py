"""One membership version's ``torch.distributed`` process group, and the few collectives a step needs.

The dispatcher names a fresh store per membership version — a ``FileStore`` path on one node, or
rank 0's ``TCPStore`` under a key prefix of the version's own across nodes
(:mod:`drafter_worker.rendezvous`); every rank opens it and joins with the rank it was given,
first marking its arrival in the store (so a rendezvous that fails can say how many ranks came).
Every collective carries ``drafter.collective_timeout_s``, so a rank whose peer died never waits
longer than that (gloo usually notices a dead peer's closed socket at once, and a client of a
dead rank 0's TCPStore its closed connection). No pickle: job ids travel as fixed-size int64
tensors, never through ``all_gather_object``.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from common.protocol import parse_tcp_store, store_address
from drafter_worker.rendezvous import RendezvousServer

log = logging.getLogger("hsd.drafter")

NO_JOB = -1  # padding of a rank's job id row
HEAD = 6  # fields before the job ids in a row
WATCH_S = 0.25  # a rank at the rendezvous asks this often whether its version still stands
ARRIVAL_POLL_S = 0.02  # and looks this often whether every rank came (a TCPStore wait that times out logs a warning)
ARRIVED_KEY = "hsd/arrived"  # + "/<rank>": set in the store by each rank that came to the rendezvous


AllReduce = Callable[[torch.Tensor], None]  # sums a tensor in place across the ranks of a group


BUCKET_BYTES = 4 << 20  # small tensors are summed together in buckets of up to this size


def all_reduce_flat(tensors: list[torch.Tensor], all_reduce: AllReduce, *, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``tensors`` in place across the group. A tensor of ``bucket_bytes`` or more is summed as
    it is; smaller ones are packed into buckets of up to that size (one collective per bucket, not
    per tensor: a drafter's step has dozens of small gradient tensors, each collective a round trip,
    while copying a large tensor into a bucket costs more than its collective saves)."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def flush(members: list[torch.Tensor]) -> None:
        if len(members) == 1:
            all_reduce(members[0])
        elif members:
            flat = torch.cat([t.reshape(-1) for t in members])
            all_reduce(flat)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            all_reduce(tensor)
            continue
        members = buckets.setdefault((tensor.dtype, tensor.device), [])
        if sum(t.numel() * t.element_size() for t in members) + size > bucket_bytes:
            flush(members)
            members.clear()
        members.append(tensor)
    for members in buckets.values():
        flush(members)


class CollectiveFailed(RuntimeError):
    """A collective of the group failed or timed out: a peer is gone."""


class VersionEnded(CollectiveFailed):
    """The dispatcher ended this membership version while the rank waited at its rendezvous."""


class RendezvousIncomplete(CollectiveFailed):
    """Not every rank came to the rendezvous in time; ``arrived`` of them did (this one included)."""

    def __init__(self, message: str, *, arrived: int):
        super().__init__(message)
        self.arrived = arrived


@dataclass(frozen=True)
class RankRound:
    """What every rank brings to a step: its job ids and what the dispatcher last told it."""

    rank: int
    job_ids: list[int]
    done: bool
    flush: bool
    busy_us: int = 0  # microseconds the rank computed on its micro-batches (the step's busy time)
    leaving: bool = False  # the rank leaves the group once this step ends (it was asked to stop)
    busy_step: int = 0  # the step busy_us was measured on (a GPU's figures come a step late; 0: none yet)


class StepGroup:
    def __init__(self, *, store: str, rank: int, world_size: int, version: int, timeout_s: float,
                 max_jobs: int, device: torch.device | str = "cpu", rendezvous_timeout_s: float | None = None,
                 still_current: Callable[[], bool] | None = None, server: RendezvousServer | None = None):
        """Join membership ``version`` on its ``store`` (a FileStore path, or ``tcp://HOST:PORT/PREFIX``:
        ``server`` when it is this rank's own). Every rank first marks its arrival in the store and
        waits up to ``rendezvous_timeout_s`` (default ``timeout_s``) for all of them, so a rendezvous
        that fails says how many came; only then is the process group opened, its collectives
        bounded by ``timeout_s``. While it waits it asks ``still_current`` every ``WATCH_S``: a
        version the dispatcher ended raises VersionEnded at once."""
        self._still_current = still_current
        self.rank, self.world_size, self.version = rank, world_size, version
        self.max_jobs = max_jobs  # job ids one rank contributes to a step, at most
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        started = time.monotonic()
        wait_s = rendezvous_timeout_s if rendezvous_timeout_s is not None else timeout_s
        deadline = started + wait_s
        try:
            self._store = self._open_store(store, server, timeout_s=timeout_s, deadline=deadline)
            self._await_ranks(self._store, deadline, wait_s)
            dist.init_process_group(backend, store=self._store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RendezvousIncomplete, VersionEnded):
            raise
        except (RuntimeError, ValueError) as exc:  # DistStoreError and friends: the others never came,
            # or rank 0's TCPStore went away with its process (DistNetworkError, at once)
            raise CollectiveFailed(f"rendezvous of membership {version} failed: {exc}") from None
        log.info("rank %d/%d of membership %d joined in %.2fs (%s)", rank, world_size, version,
                 time.monotonic() - started, backend)

    def _open_store(self, name: str, server: RendezvousServer | None, *, timeout_s: float,
                    deadline: float) -> dist.Store:
        tcp = parse_tcp_store(name)
        if tcp is None:
            return dist.FileStore(name, self.world_size)
        host, port, prefix = tcp
        if server is not None and server.address == store_address(host, port):
            base = server.store  # this rank is the version's rank 0
        else:
            self._reach(host, port, deadline)
            base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore(prefix, base)  # the version's own keys: earlier versions' stay apart

    def _reach(self, host: str, port: int, deadline: float) -> None:
        """Wait until rank 0's store accepts connections. One that refuses has not gone for good
        as far as the dispatcher knows: a rank 0 dead on another node stays in its version until its
        heartbeats stop, which ends the version (VersionEnded), as for a rank that never comes.
        (A TCPStore client would retry on its own, logging an error per try.)"""
        while True:
            try:
                with socket.create_connection((host, port), timeout=WATCH_S):
                    return
            except OSError as exc:
                reason = exc
            self._watch(deadline, lambda: RendezvousIncomplete(
                f"rendezvous of membership {self.version}: rank 0's store at {store_address(host, port)} did not "
                f"answer ({reason})", arrived=1))
            time.sleep(WATCH_S)

    def _await_ranks(self, store: dist.Store, deadline: float, timeout_s: float) -> None:
        keys = [f"{ARRIVED_KEY}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], "1")

        def incomplete() -> RendezvousIncomplete:
            arrived = sum(store.check([key]) for key in keys)
            return RendezvousIncomplete(f"rendezvous of membership {self.version}: {arrived} of {self.world_size} "
                                        f"ranks came within {timeout_s:g}s", arrived=arrived)

        watched = time.monotonic()
        while not store.check(keys):  # polled, not waited on: a TCPStore wait that times out logs a warning
            if time.monotonic() >= deadline or time.monotonic() - watched >= WATCH_S:
                self._watch(deadline, incomplete)
                watched = time.monotonic()
            time.sleep(ARRIVAL_POLL_S)

    def _watch(self, deadline: float, incomplete: Callable[[], RendezvousIncomplete]) -> None:
        """While a rank waits at the rendezvous: past ``deadline`` it gives up, and a version the
        dispatcher ended ends its wait at once."""
        if time.monotonic() >= deadline:
            raise incomplete()
        if self._still_current is not None and not self._still_current():
            raise VersionEnded(f"membership {self.version} ended while rank {self.rank} waited at its rendezvous")

    def _run(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except (RuntimeError, ValueError) as exc:  # gloo raises RuntimeError for timeouts and closed peers
            raise CollectiveFailed(f"{what} of membership {self.version} failed: {exc}") from None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the group, in place."""
        self._run("all_reduce", dist.all_reduce, tensor)

    def exchange(self, mine: RankRound) -> list[RankRound]:
        """Every rank's round, in rank order: ``[count, done, flush, busy_us, leaving, busy_step, ids...,
        padding]`` per rank."""
        if len(mine.job_ids) > self.max_jobs:
            raise ValueError(f"a rank brings {len(mine.job_ids)} jobs to a step, more than {self.max_jobs}")
        row = torch.full((HEAD + self.max_jobs,), NO_JOB, dtype=torch.int64, device=self.device)
        row[:HEAD] = torch.tensor([len(mine.job_ids), int(mine.done), int(mine.flush), mine.busy_us, int(mine.leaving),
                                   mine.busy_step])
        if mine.job_ids:
            row[HEAD:HEAD + len(mine.job_ids)] = torch.tensor(mine.job_ids, dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        self._run("job exchange", dist.all_gather, rows, row)
        rounds = []
        for rank, r in enumerate(rows):
            values = r.tolist()
            rounds.append(RankRound(rank, values[HEAD:HEAD + values[0]], bool(values[1]), bool(values[2]), values[3],
                                    bool(values[4]), values[5]))
        return rounds

    def broadcast(self, *values: int) -> list[int]:
        """Rank 0's ``values`` on every rank."""
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._run("broadcast", dist.broadcast, tensor, 0)
        return tensor.tolist()

    def broadcast_tensor(self, tensor: torch.Tensor, source: int = 0) -> None:
        """``tensor`` of rank ``source`` into every rank's ``tensor``, in place."""
        self._run("state broadcast", dist.broadcast, tensor, source)

    def close(self) -> None:
        self._store = None  # a client of rank 0's TCPStore disconnects once the group lets go of it too
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as exc:  # a broken group may not tear down cleanly
                log.warning("closing the process group of membership %d: %s", self.version, exc)
