"""What the benchmark dispatcher spent while a pair of ``hsd bench transport``'s workers ran: its
process's CPU time, and from its stats socket where its loop's went, the requests it answered and
its loop's wake-ups (:mod:`benchmarks.transport`)."""

from __future__ import annotations

from typing import Callable

import psutil

from common.wire import messages
from common.wire.client import DispatcherClient
from common.wire.stats_figures import counter_delta


class DispatcherCPU:
    """The dispatcher process's CPU time (user and system, every thread) while a pair of workers runs."""

    def __init__(self, process: psutil.Process, stats: DispatcherClient):
        self.process = process
        self.stats = stats  # its stats socket: where its socket loop's CPU went (loop_cpu_s)
        self.loop_cpu_s: dict[str, float] = {}  # over the last while_running(), by op or phase
        self.requests: dict[str, int] = {}  # ... and its requests by op
        self.wakeups = 0  # ... and its loop's wake-ups

    def seconds(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def while_running(self, run: Callable[[], dict]) -> tuple[dict, float]:
        """``run()``'s result and the dispatcher's CPU seconds meanwhile (and, in ``loop_cpu_s`` and
        ``requests``, where its loop's went and the requests it answered)."""
        before = self.stats.call(messages.Stats(), timeout_s=30.0).stats
        cpu = self.seconds()
        result = run()
        cpu = self.seconds() - cpu
        after = self.stats.call(messages.Stats(), timeout_s=30.0).stats
        # the stats requests are the bench's own
        self.loop_cpu_s = {what: s for what, s in counter_delta(before.loop_cpu_s, after.loop_cpu_s).items()
                           if what != "stats"}
        self.requests = {op: n for op, n in counter_delta(before.requests, after.requests).items() if op != "stats"}
        self.wakeups = after.loop_wakeups - before.loop_wakeups
        return result, cpu
