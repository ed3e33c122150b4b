"""The jobs a worker holds, as the heartbeat reports them to the dispatcher.

A job is held from the moment its grant reply arrives (a prefetched grant counts although the
worker has not looked at it yet) until the worker has reported it: ready or failed for a target,
committed or dropped for a drafter. The dispatcher gives back any job it believes the worker holds
that the heartbeat does not list and that was granted no later than the latest grant the worker
received (``seen_grant``: grants are numbered per session, so a reply still on its way is never
mistaken for a dropped job), so dropping work is simply forgetting it here. The set is written
by the worker's I/O thread and main thread and read by its heartbeat: every access takes the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class HeldJobs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[int] = set()
        self.seen_grant = 0  # number of the latest grant received in this session

    def add(self, job_id: int, grant: int = 0) -> None:
        with self._lock:
            self._ids.add(job_id)
            self.seen_grant = max(self.seen_grant, grant)

    def discard(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            self._ids.difference_update(job_ids)

    def clear(self) -> None:
        """A new session: nothing held, grants counted from 1 again."""
        with self._lock:
            self._ids.clear()
            self.seen_grant = 0

    def snapshot(self) -> list[int]:
        with self._lock:
            return sorted(self._ids)

    def heartbeat_fields(self) -> dict[str, object]:
        with self._lock:
            return {"holding": sorted(self._ids), "seen_grant": self.seen_grant}

    def __contains__(self, job_id: int) -> bool:
        with self._lock:
            return job_id in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
