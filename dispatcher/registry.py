"""The dispatcher's live sessions: who is registered, with which token, and how long each waited.

A worker id carries the dispatcher's incarnation (``t0.3``: the first target of the fourth start), so
a worker still speaking for a previous dispatcher's ``t0`` gets ``unknown_worker``, never the new
``t0``'s jobs.
"""

from __future__ import annotations

import secrets
from collections import Counter
from typing import Any

from dispatcher.core_types import Unauthorized, UnknownWorker, Worker


class WorkerRegistry:
    def __init__(self, incarnation: int):
        self.incarnation = incarnation
        self.workers: dict[str, Worker] = {}  # changed only by add() and remove(), which keep the indexes below
        self._next_number: Counter[str] = Counter()
        # the live sessions by (name, role, host) and by model, each in registration order: a worker that
        # registers looks its earlier sessions and its model's other drafters up without a walk of all
        self._sessions: dict[tuple[str, str, str], dict[str, Worker]] = {}
        self._by_model: dict[str, dict[str, Worker]] = {}
        self.on_node: Counter[tuple[str, str]] = Counter()  # (node, role) -> live workers (the stats' node view)

    def add(self, worker: Worker) -> None:
        self.workers[worker.id] = worker
        self._sessions.setdefault((worker.name, worker.role, worker.host), {})[worker.id] = worker
        if worker.model is not None:
            self._by_model.setdefault(worker.model, {})[worker.id] = worker
        self.on_node[worker.node, worker.role] += 1

    def remove(self, worker_id: str) -> Worker:
        worker = self.workers.pop(worker_id)
        self.on_node[worker.node, worker.role] -= 1
        if not self.on_node[worker.node, worker.role]:
            del self.on_node[worker.node, worker.role]
        for index, key in ((self._sessions, (worker.name, worker.role, worker.host)), (self._by_model, worker.model)):
            same = index.get(key)
            if same is not None:
                same.pop(worker_id, None)
                if not same:
                    del index[key]
        return worker

    def new_id(self, role: str) -> str:
        worker_id = f"{role[0]}{self._next_number[role]}.{self.incarnation}"
        self._next_number[role] += 1
        return worker_id

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(16)

    def sessions_of(self, name: str, role: str, host: str) -> list[Worker]:
        """The live sessions of one worker process's name (it registers again: they are replaced)."""
        return list(self._sessions.get((name, role, host), {}).values())

    def models(self) -> set[str]:
        """The models some live drafter trains."""
        return set(self._by_model)

    def of_model(self, model: str) -> list[Worker]:
        """The live drafters of ``model``, in the order they registered."""
        return list(self._by_model.get(model, {}).values())

    def get(self, worker_id: str, now: float, *, touch: bool = True) -> Worker:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(worker_id)
        if touch:
            worker.last_seen = now
        return worker

    def authenticate(self, worker_id: str, token: Any, now: float) -> Worker:
        worker = self.get(worker_id, now, touch=False)
        if not isinstance(token, str) or not secrets.compare_digest(token, worker.token):
            raise Unauthorized(f"request for {worker_id} without its session token")
        worker.last_seen = now
        return worker

    def free_queue(self, num_queues: int) -> int | None:
        """Per-target assignment: the lowest queue no live target takes from (None: every queue has one)."""
        taken = {w.queue for w in self.workers.values() if w.queue is not None}
        return next((k for k in range(num_queues) if k not in taken), None)

    @staticmethod
    def wait(worker: Worker, reason: str, now: float) -> None:
        if worker.waiting_since is None:
            worker.waiting_since = now
        worker.wait_reason = reason

    @staticmethod
    def end_wait(worker: Worker, now: float) -> None:
        if worker.waiting_since is not None:
            worker.total_wait_s += now - worker.waiting_since
            worker.waiting_since = None
            worker.wait_reason = ""
