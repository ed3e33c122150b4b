"""Where the socket loop's CPU time goes: each stretch of the loop thread's CPU time booked to what
it was spent on.

The loop reads its thread's CPU clock once per message it answers and a few times per wake-up, and
:meth:`LoopCpu.charge` books the time since the previous reading to a name:

- a request's op (``get_job``, ``get_hs``, ``commit_step``, ...): receiving it, decoding, the core's
  work, encoding and sending the reply; a parked poll answered later books that answer to its op too;
- ``poll``: the poller's wait (the kernel's and ZeroMQ's work as the loop wakes up);
- ``serve``: trying parked polls again after a state change, less the polls it answered;
- ``expire``: polls answered empty at their deadline;
- ``sweep``: sweeps, journal flushes, the core's snapshots (its state on disk) and progress lines;
- ``durable``: replies released once the journal synced them, and handshake monitors;
- ``stats``: the read-only stats socket, and the stats snapshots it and ``/metrics`` are sent,
  built a step a turn of the loop.

It also counts the loop's wake-ups (each return of its poller: messages waiting, a deadline, a
timer), since a message that arrives alone pays for waking the loop, and one that shares a wake-up
with others costs little more than its decode (docs/benchmarks.md).

The totals reach ``hsd stats`` (``loop_cpu_s``, ``loop_wakeups``) and ``/metrics``; ``hsd bench scale`` divides them by
items. A reading costs about half a microsecond (the thread CPU clock is a system call), one per
message: about 1 % of what a message costs the loop. The loop's thread is the one that calls; the
journal's sync thread and ZeroMQ's I/O thread are not in these figures.
"""

from __future__ import annotations

import time
from collections import Counter

_thread_ns = time.thread_time_ns  # looked up once: called for every message


class LoopCpu:
    def __init__(self) -> None:
        self.ns: Counter[str] = Counter()
        self.wakeups = 0
        self._mark = _thread_ns()

    def woke(self) -> None:
        """The poller returned: one more wake-up, its cost (the kernel's and ZeroMQ's) booked to ``poll``."""
        self.wakeups += 1
        self.charge("poll")

    def charge(self, what: str) -> None:
        """Book this thread's CPU time since the previous charge to ``what``."""
        now = _thread_ns()
        self.ns[what] += now - self._mark
        self._mark = now

    def seconds(self) -> dict[str, float]:
        """The totals so far, in seconds, by what they were spent on."""
        return {what: round(ns / 1e9, 6) for what, ns in self.ns.items()}
