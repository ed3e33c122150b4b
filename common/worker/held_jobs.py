"""The jobs a worker holds, as the heartbeat reports them to the dispatcher.

A job is held from the moment its grant reply arrives (a prefetched grant counts although the
worker has not looked at it yet) until the worker has reported it: ready or failed for a target,
committed or dropped for a drafter. The dispatcher gives back any job it believes the worker holds
that the heartbeat does not list, so dropping work is simply forgetting it here. The set is written
by the worker's I/O thread and main thread and read by its heartbeat: every access takes the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class HeldJobs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[int] = set()

    def add(self, job_id: int) -> None:
        with self._lock:
            self._ids.add(job_id)

    def discard(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            self._ids.difference_update(job_ids)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()

    def snapshot(self) -> list[int]:
        with self._lock:
            return sorted(self._ids)

    def __contains__(self, job_id: int) -> bool:
        with self._lock:
            return job_id in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
