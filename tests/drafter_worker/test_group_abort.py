"""A rank SIGKILLed inside the gradient all-reduce: the survivor's collective fails within a fraction
of its bound (gloo sees the closed socket), its group is aborted, and it opens the next version
and sums again. On GPUs the same path runs with the gradients on NCCL, the rest on gloo
(drafter_worker/process_group.py); here, on the CPU, every collective is gloo's."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from abort_ranks import TIMEOUT_S, rank_main, stopped_rank_main
from hsd_testing import child_message, started


def test_a_rank_killed_inside_the_all_reduce_fails_the_survivors_collective_and_it_goes_on(tmp_path):
    ctx = mp.get_context("spawn")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=rank_main, args=(rank, str(tmp_path), *queues[rank])) for rank in range(2)]
    with started(procs):
        assert child_message(queues[0][0], procs[0]) == "entering"
        queues[1][1].put("go")
        procs[1].join(timeout=120)
        assert procs[1].exitcode == -9
        kind, waited_s, message = child_message(queues[0][0], procs[0])
        assert kind == "CollectiveFailed" and "all_reduce of membership 1" in message, (kind, message)
        assert waited_s < TIMEOUT_S / 4, waited_s  # the closed socket, not the bound
        assert child_message(queues[0][0], procs[0]) == (True, False)  # aborted, before close
        assert child_message(queues[0][0], procs[0]) == 3.0  # version 2, alone
        procs[0].join(timeout=60)
        assert procs[0].exitcode == 0


def test_a_stopped_rank_does_not_hold_the_survivor_once_the_dispatcher_ended_the_version(tmp_path):
    """A peer stopped (SIGSTOP), not dead, closes no socket: gloo alone would keep the survivor in the
    exchange for the whole bound. Once the version is ended (in a run: a heartbeat's answer names no
    version), the survivor leaves the collective within its watch, lets go of the group at once
    (the collective still in flight does not hold it) and sums alone in the next version."""
    ctx = mp.get_context("spawn")
    (out, rank1_out), ended = (ctx.Queue(), ctx.Queue()), ctx.Event()
    procs = [ctx.Process(target=stopped_rank_main, args=(rank, str(tmp_path), queue, ended))
             for rank, queue in enumerate((out, rank1_out))]
    with started(procs):
        assert child_message(rank1_out, procs[1]) == "opened"
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:
            assert child_message(out, procs[0]) == "entering"
            ended.set()
            kind, waited_s, message = child_message(out, procs[0])
            assert kind == "VersionEnded" and "all_reduce of membership 1 left" in message, (kind, message)
            assert waited_s < TIMEOUT_S / 4, waited_s
            broken, initialized, close_s = child_message(out, procs[0])
            assert broken and not initialized and close_s < 5, close_s
            assert child_message(out, procs[0]) == 3.0  # version 2, alone
            procs[0].join(timeout=60)
            assert procs[0].exitcode == 0
        finally:
            os.kill(procs[1].pid, signal.SIGCONT)
