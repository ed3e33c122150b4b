"""When a worker's heartbeat goes out: when the worker has otherwise been silent.

The dispatcher counts every authenticated request as a sign of life (``dispatcher.registry``), so a
worker that sent a request within the last heartbeat interval is alive to it already: the beat due
then is skipped, and a busy worker's requests carry its liveness. Beats still matter where a worker
sends nothing: a rank waiting in a collective learns from a beat's answer that its version ended, and
a worker parked in a long poll learns from a refused beat that the dispatcher restarted; such a
worker is silent, so its beats go out.

A beat also lists the jobs the worker holds, and a grant whose reply was lost is given back only
when a beat leaves it out (``dispatcher.job_ops.give_back_unlisted``). So a busy worker still beats
at every :data:`LIST_HELD_EVERY`-th beat's time: its list reaches the dispatcher at least that often.
"""

from __future__ import annotations

LIST_HELD_EVERY = 8  # a busy worker's beats: one in this many due (4 s at the default 0.5 s interval)


class BeatSchedule:
    """Decides, each time a beat is due, whether it goes out (pure: the caller keeps the clock)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.skipped = 0  # beats skipped in a row

    def goes_out(self, now: float, last_request_at: float) -> bool:
        """The beat due at ``now`` goes out unless a request went out within the last interval (and
        fewer than LIST_HELD_EVERY - 1 beats were skipped since the last one that went out)."""
        if now - last_request_at < self.interval_s and self.skipped < LIST_HELD_EVERY - 1:
            self.skipped += 1
            return False
        self.skipped = 0
        return True
