"""The ranks of tests/drafter_worker/test_group_abort.py: a module importable by name, so a spawned
child process can find its entry point."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from drafter_worker.process_group import CollectiveFailed, StepGroup, VersionEnded

TIMEOUT_S = 60.0  # every collective's bound here: what the survivor must not wait out
NUMEL = 1 << 22  # 16 MB of float32: one bucket summed as it is, as a large gradient is


def rank_main(rank: int, store_dir: str, out, orders) -> None:
    """Version 1 of two ranks: rank 0 enters the all-reduce of a gradient; rank 1, told to, enters it
    too and SIGKILLs itself inside it. Rank 0 reports how its all-reduce ended, then trains on
    alone in version 2 (a group of its own)."""
    group = StepGroup(store=os.path.join(store_dir, "v1"), rank=rank, world_size=2, version=1, timeout_s=TIMEOUT_S,
                      max_jobs=1)
    grad = torch.ones(NUMEL)
    if rank == 1:
        orders.get()
        dist.all_reduce(grad, async_op=True)  # the peer's collective is under way with this rank's part in it
        os.kill(os.getpid(), signal.SIGKILL)
    out.put("entering")
    started = time.monotonic()
    try:
        group.all_reduce(grad)
        out.put(("completed", time.monotonic() - started, ""))
    except CollectiveFailed as exc:
        out.put((type(exc).__name__, time.monotonic() - started, str(exc)))
    out.put((group.broken, dist.is_initialized()))
    group.close()
    alone = StepGroup(store=os.path.join(store_dir, "v2"), rank=0, world_size=1, version=2, timeout_s=TIMEOUT_S,
                      max_jobs=1)
    grad.fill_(3.0)
    alone.all_reduce(grad)
    alone.close()
    out.put(float(grad[0]))


def stopped_rank_main(rank: int, store_dir: str, out, ended) -> None:
    """Version 1 of two ranks, whose collectives watch ``ended`` (set once the dispatcher ended the
    version: its heartbeat answers say so in a run). Rank 1 opens the group and waits to be stopped
    (SIGSTOP: its sockets stay open, so gloo alone would wait out the whole bound). Rank 0 enters the
    job exchange, reports how it ended and how long it took to let go of the group, then sums alone
    in version 2."""
    def watch():
        def check() -> None:
            if ended.is_set():
                raise VersionEnded("the dispatcher ended membership 1")
        return check
    group = StepGroup(store=os.path.join(store_dir, "v1"), rank=rank, world_size=2, version=1, timeout_s=TIMEOUT_S,
                      max_jobs=1, watch=watch)
    if rank == 1:
        out.put("opened")
        time.sleep(TIMEOUT_S)  # stopped meanwhile; killed by the test
        return
    out.put("entering")
    started = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
        out.put(("completed", time.monotonic() - started, ""))
    except CollectiveFailed as exc:
        out.put((type(exc).__name__, time.monotonic() - started, str(exc)))
    started = time.monotonic()
    group.close()
    out.put((group.broken, dist.is_initialized(), time.monotonic() - started))
    alone = StepGroup(store=os.path.join(store_dir, "v2"), rank=0, world_size=1, version=2, timeout_s=TIMEOUT_S,
                      max_jobs=1)
    grad = torch.full((4,), 3.0)
    alone.all_reduce(grad)
    alone.close()
    out.put(float(grad[0]))
