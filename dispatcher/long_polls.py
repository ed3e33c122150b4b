"""The dispatcher's long polls: ``get_job``, ``get_hs`` and ``join_group`` that cannot be answered yet.

A poll that finds nothing is parked as a :class:`Waiter` holding its typed request, tried again
after every state change, and answered empty at its deadline (``wait_ms``, at most MAX_WAIT_MS).
A worker asks again only after it gave up on its earlier poll, so a newer poll of the same op
replaces the parked one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from common.wire import messages
from common.wire.messages import ErrorCode
from dispatcher.core import DispatcherCore
from dispatcher.core_types import DONE, STEP_FULL, UnknownWorker
from dispatcher.groups import GroupChanged
from dispatcher.ledger import LedgerError

MAX_WAIT_MS = 30_000

Poll = Union[messages.GetJob, messages.GetHS, messages.JoinGroup]
PollReply = Union[messages.GrantReply, messages.JoinGroupReply]


def counted_error(core: DispatcherCore, request_id: int | None, code: str, message: str) -> messages.ErrorReply:
    """An error reply, counted in the stats snapshot's ``errors``."""
    core.counters.errors[code] += 1
    return messages.error_reply(request_id, code, message)


def model_step(core: DispatcherCore, worker_id: str) -> int:
    """The step the ledger holds for the worker's model (0: none, or the worker is gone)."""
    worker = core.workers.get(worker_id)
    return core.ledger.model_step.get(worker.model, 0) if worker is not None and worker.model else 0


@dataclass
class Waiter:
    identity: bytes
    request: Poll
    deadline: float

    @property
    def worker_id(self) -> str:
        return self.request.worker_id


class LongPolls:
    def __init__(self, core: DispatcherCore, send: Callable[[bytes, messages.Reply], None]):
        self.core = core
        self.send = send  # to the control socket
        self.waiters: list[Waiter] = []

    @property
    def next_deadline(self) -> float:
        """When the first parked poll is due (inf: none is parked)."""
        return min((w.deadline for w in self.waiters), default=float("inf"))

    def poll(self, identity: bytes, request: Poll, now: float) -> tuple[PollReply | None, bool]:
        """(the answer now, whether the pool changed: it handed something out or freed a slot): the
        empty answer of a poll that does not wait, or None for one parked until something can be
        handed out or its deadline. The consumed reports a get_hs carries are applied first, once,
        whatever becomes of the poll."""
        freed = isinstance(request, messages.GetHS) and bool(request.consumed) and self.core.consumed_with_poll(
            request.worker_id, request.consumed, now) > 0
        reply = self._try_serve(request, now)
        if reply is not None:
            return reply, True
        return self._park(identity, request, now), freed  # a freed slot may serve a parked get_job

    def _park(self, identity: bytes, request: Poll, now: float) -> PollReply | None:
        """Park a poll that found nothing (None), or the empty answer of one that does not wait."""
        wait_ms = min(max(0, request.wait_ms), MAX_WAIT_MS)
        if wait_ms == 0:
            return self._empty_reply(request)
        kind = type(request)
        self.waiters = [w for w in self.waiters if (w.worker_id, type(w.request)) != (request.worker_id, kind)]
        self.waiters.append(Waiter(identity, request, now + wait_ms / 1000))
        return None

    def _try_serve(self, request: Poll, now: float) -> PollReply | None:
        core, worker_id = self.core, request.worker_id
        if isinstance(request, messages.JoinGroup):
            membership = core.join_group(worker_id, now, after=request.after, step=request.step,
                                         failed=request.failed)
            if membership is None:
                return None
            return messages.JoinGroupReply(id=request.id, group=membership.to_wire(),
                                           model_step=model_step(core, worker_id), membership=membership.version)
        if isinstance(request, messages.GetJob):
            grant, flush = core.get_job(worker_id, now), False
        else:
            grant, flush = core.get_hs(worker_id, now, membership=request.membership)
        if grant is None:
            return None
        if grant == DONE:
            return messages.GrantReply(id=request.id, job=None, done=True, flush=True)
        if grant == STEP_FULL:
            # the step it speaks of: a reply that arrives once that step committed is stale
            return messages.GrantReply(id=request.id, job=None, done=False,
                                       step_full=model_step(core, worker_id) + 1)
        ipc = core.workers[grant.owner].ipc_block if grant.owner and isinstance(request, messages.GetHS) else None
        return messages.GrantReply(id=request.id, job=grant.to_wire(ipc_block=ipc), done=False, flush=flush)

    def _empty_reply(self, request: Poll) -> PollReply:
        core, worker_id = self.core, request.worker_id
        if isinstance(request, messages.JoinGroup):  # membership: the version naming this rank now (0: it waits)
            named = core.workers[worker_id].group if worker_id in core.workers else None
            reload = core.checkpoint_to_load(worker_id) if worker_id in core.workers else None
            return messages.JoinGroupReply(id=request.id, group=None, model_step=model_step(core, worker_id),
                                           membership=named.version if named is not None else 0, reload=reload)
        core.end_wait(worker_id, time.monotonic())
        flush = isinstance(request, messages.GetHS) and core.nothing_left_to_hand_out()
        return messages.GrantReply(id=request.id, job=None, done=core.done, flush=flush)

    def serve(self, now: float) -> None:
        """Try every parked poll again (after a state change), in the order they were parked.

        While no ready slot may be handed out, every lone drafter's get_hs finds nothing, and finding
        nothing changes nothing: that is asked once (``lone_drafters_starved``) for them all rather than
        once each (hundreds of parked drafters, at every state change). It is asked again after a
        poll was answered or one that may change the state was tried (a join, a group rank's get_hs)."""
        remaining = []
        core = self.core
        starved: bool | None = None  # None: not asked since the state last changed
        for waiter in self.waiters:
            request_id = waiter.request.id
            if isinstance(waiter.request, messages.GetHS) and core.is_lone_drafter(waiter.worker_id):
                if starved is None:
                    starved = core.lone_drafters_starved()
                if starved:
                    core.starved(waiter.worker_id, now)
                    remaining.append(waiter)
                    continue
            elif not isinstance(waiter.request, messages.GetJob):
                starved = None
            try:
                reply = self._try_serve(waiter.request, now)
            except UnknownWorker:
                reply = counted_error(self.core, request_id, ErrorCode.UNKNOWN_WORKER,
                                      f"worker {waiter.worker_id} is not registered")
            except GroupChanged as exc:  # a parked get_hs of a rank whose group just changed: tell it now
                reply = counted_error(self.core, request_id, ErrorCode.GROUP_CHANGED, str(exc))
            except LedgerError as exc:
                reply = counted_error(self.core, request_id, ErrorCode.BAD_STATE, str(exc))
            if reply is None:
                remaining.append(waiter)
            else:
                self.send(waiter.identity, reply)
                starved = None
        self.waiters = remaining

    def expire(self, now: float) -> None:
        """Answer every poll past its deadline empty."""
        if not self.waiters:
            return
        expired = [w for w in self.waiters if w.deadline <= now]
        if not expired:
            return
        self.waiters = [w for w in self.waiters if w.deadline > now]
        for waiter in expired:
            if waiter.worker_id not in self.core.workers:
                reply = counted_error(self.core, waiter.request.id, ErrorCode.UNKNOWN_WORKER,
                                      f"worker {waiter.worker_id} is not registered")
            else:
                reply = self._empty_reply(waiter.request)
            self.send(waiter.identity, reply)

    def drop(self, worker_id: str) -> None:
        """The worker left: its parked polls go unanswered."""
        self.waiters = [w for w in self.waiters if w.worker_id != worker_id]

    def close(self) -> None:
        """The dispatcher stops: every parked poll is told so."""
        for waiter in self.waiters:
            self.send(waiter.identity, counted_error(self.core, waiter.request.id, ErrorCode.UNKNOWN_WORKER,
                                                     "the dispatcher is stopping"))
        self.waiters = []
