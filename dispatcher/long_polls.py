"""The dispatcher's long polls: ``get_job``, ``get_hs`` and ``join_group`` that cannot be answered yet.

A poll that finds nothing is parked as a :class:`Waiter` holding its typed request, tried again
after every state change, and answered empty at its deadline (``wait_ms``, at most MAX_WAIT_MS).
A worker asks again only after it gave up on its earlier poll, so a newer poll of the same op
replaces the parked one.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

from common.wire import messages
from common.wire.messages import ErrorCode
from dispatcher.core import DispatcherCore
from dispatcher.core_types import DONE, STEP_FULL, UnknownWorker
from dispatcher.groups import DrafterGroup, GroupChanged
from dispatcher.ledger import LedgerError
from dispatcher.loop_cpu import LoopCpu

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
    seq: int = 0  # the order it was parked in (a newer poll of the same worker and op replaces it)

    @property
    def worker_id(self) -> str:
        return self.request.worker_id


WaiterKey = tuple[str, type]


@dataclass
class SharedWait:
    """A queue of parked polls that all find nothing for one reason while it holds: ``why()`` (asked
    once for the whole queue; None when some of them may be served) and ``note(worker_id, reason,
    now)`` (what a poll that waits for that reason leaves on its worker). A poll is noted when it
    is parked or tried in vain, and all of them again when the reason changes."""

    why: Callable[[], str | None]
    note: Callable[[str, str, float], None]
    waiters: dict[WaiterKey, Waiter] = field(default_factory=dict)
    unnoted: set[WaiterKey] = field(default_factory=set)  # parked or tried since the queue was last noted
    noted_for: str | None = None  # the reason the polls not tried since were last noted with

    def add(self, key: WaiterKey, waiter: Waiter) -> None:
        self.waiters[key] = waiter
        self.unnoted.add(key)

    def discard(self, key: WaiterKey) -> None:
        self.waiters.pop(key, None)
        self.unnoted.discard(key)

    def clear(self) -> None:
        self.waiters, self.unnoted, self.noted_for = {}, set(), None

    def noted(self, reason: str, workers: dict, now: float) -> None:
        """The polls not tried find nothing: each waits for ``reason``."""
        for key in (self.waiters if reason != self.noted_for else self.unnoted):
            if key[0] in workers:
                self.note(key[0], reason, now)
        self.unnoted.clear()
        self.noted_for = reason


@dataclass
class RankWait(SharedWait):
    """The parked ``get_hs`` of ranks of data-parallel groups balanced by count. Like a lone drafter's,
    a rank's poll finds nothing while no ready slot may be handed out, but only while its group stands
    as it stood when the poll was last tried: a try also opens the next version at a step boundary
    when ranks wait to join, and tells a rank whose version ended (GroupChanged). So a group with a
    rank waiting, or at another version than its ranks' polls were last tried at, is *stale*: its
    parked polls are each tried (:meth:`LongPolls.serve`), the others share the queue's one look."""

    model_of: dict[WaiterKey, str] = field(default_factory=dict)  # a parked poll -> its rank's group's model
    parked: Counter[str] = field(default_factory=Counter)  # model -> its ranks' parked polls
    tried_at: dict[str, int] = field(default_factory=dict)  # model -> the version its parked polls were tried at

    def add_rank(self, key: WaiterKey, waiter: Waiter, group: DrafterGroup) -> None:
        """Park a rank's poll (its key not parked), just tried at its group's current version."""
        self.add(key, waiter)
        self.model_of[key] = group.model
        self.parked[group.model] += 1
        if self.parked[group.model] == 1:  # the group's only parked poll: tried now, at this version
            self.tried_at[group.model] = group.version

    def discard(self, key: WaiterKey) -> None:
        super().discard(key)
        model = self.model_of.pop(key, None)
        if model is not None:
            self.parked[model] -= 1
            if not self.parked[model]:
                del self.parked[model]

    def clear(self) -> None:
        super().clear()
        self.model_of, self.parked, self.tried_at = {}, Counter(), {}

    def take_stale(self, groups: dict[str, DrafterGroup]) -> list[tuple[WaiterKey, Waiter]]:
        """The parked polls to try each, in the order they were parked: those of the groups that are
        stale (asked once a group), whose versions are noted as tried at (before the tries: a change
        one of them makes is seen at the next serve)."""
        stale = {model: group.version for model in self.parked if (group := groups.get(model)) is not None
                 and (group.waiting or self.tried_at.get(model) != group.version)}
        if not stale:
            return []
        self.tried_at.update(stale)
        return [(key, waiter) for key, waiter in self.waiters.items() if self.model_of.get(key) in stale]


class LongPolls:
    """The parked polls, in the order they were parked, kept in four queues: lone drafters' ``get_hs``
    (all of them find nothing while no ready slot may be handed out), count-balanced group ranks'
    ``get_hs`` (the same, while their groups stand: :class:`RankWait`) and targets' ``get_job`` (all
    of them find nothing while no job is pending or no slot is free), each a :class:`SharedWait`
    asked once for the whole queue, and the rest (a cost-balanced rank's ``get_hs``, ``join_group``),
    each tried. A rank stays a rank of one group for the life of its worker id, so a poll's queue is
    known when it is parked. Deadlines sit in a heap, so finding the next one and expiring the due
    ones cost nothing per parked poll."""

    def __init__(self, core: DispatcherCore, send: Callable[[bytes, messages.Reply], None], *,
                 loop_cpu: LoopCpu | None = None):
        self.core = core
        self.send = send  # to the control socket
        self.loop_cpu = loop_cpu  # a parked poll answered by serve(): its CPU is booked to its op
        self._lone_hs = SharedWait(why=lambda: "starved" if core.lone_drafters_starved() else None,
                                   note=lambda worker_id, _, now: core.starved(worker_id, now))
        self._ranks = RankWait(why=self._lone_hs.why, note=self._lone_hs.note)
        self._targets = SharedWait(why=core.targets_wait, note=core.target_waits)
        self._shared = (self._ranks, self._targets, self._lone_hs)  # served in this order, as parked within each
        self._others: dict[WaiterKey, Waiter] = {}
        self._deadlines: list[tuple[float, int, WaiterKey]] = []  # a heap; an entry whose waiter left is skipped
        self._seq = 0

    @property
    def waiters(self) -> list[Waiter]:
        """Every parked poll (the others first, then the ranks' get_hs, the targets' get_job and the lone
        drafters' get_hs)."""
        return [*self._others.values(), *(waiter for queue in self._shared for waiter in queue.waiters.values())]

    def __len__(self) -> int:
        return len(self._others) + sum(len(queue.waiters) for queue in self._shared)

    @property
    def next_deadline(self) -> float:
        """When the first parked poll is due (inf: none is parked)."""
        heap = self._deadlines
        while heap and self._parked(heap[0]) is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def _parked(self, entry: tuple[float, int, WaiterKey]) -> Waiter | None:
        """The waiter a heap entry stands for, if it is still parked (not answered or replaced)."""
        key = entry[2]
        waiter = self._others.get(key)
        for queue in self._shared:
            waiter = waiter or queue.waiters.get(key)
        return waiter if waiter is not None and waiter.seq == entry[1] else None

    def _remove(self, key: WaiterKey) -> None:
        for queue in self._shared:
            queue.discard(key)
        self._others.pop(key, None)

    def poll(self, identity: bytes, request: Poll, now: float) -> tuple[PollReply | None, bool]:
        """(the answer now, whether the pool changed: it handed something out or freed a slot): the
        empty answer of a poll that does not wait, or None for one parked until something can be
        handed out or its deadline. The consumed reports a get_hs carries, and the job_ready reports a
        get_job carries, are applied first, once, whatever becomes of the poll."""
        if isinstance(request, messages.GetHS):
            freed = bool(request.consumed) and self.core.consumed_with_poll(request.worker_id, request.consumed, now) > 0
        else:  # a published slot may serve a parked get_hs
            freed = isinstance(request, messages.GetJob) and bool(request.ready) and self.core.ready_with_poll(
                request.worker_id, request.ready, now) > 0
        reply = self._try_serve(request, now)
        if reply is not None:
            self._remove((request.worker_id, type(request)))  # an older poll of the same op is answered by this one
            return reply, True
        return self._park(identity, request, now), freed  # a freed slot may serve a parked get_job

    def _park(self, identity: bytes, request: Poll, now: float) -> PollReply | None:
        """Park a poll that found nothing (None), or the empty answer of one that does not wait."""
        wait_ms = min(max(0, request.wait_ms), MAX_WAIT_MS)
        key = (request.worker_id, type(request))
        self._remove(key)
        if wait_ms == 0:
            return self._empty_reply(request)
        self._seq += 1
        waiter = Waiter(identity, request, now + wait_ms / 1000, self._seq)
        if isinstance(request, messages.GetHS):
            group = self.core.groups.group_of_rank(request.worker_id)
            if group is None and request.worker_id in self.core.workers:  # a lone drafter
                self._lone_hs.add(key, waiter)
            elif group is not None and group.spec.balance == "count":
                self._ranks.add_rank(key, waiter, group)
            else:
                self._others[key] = waiter
        elif isinstance(request, messages.GetJob):
            self._targets.add(key, waiter)
        else:
            self._others[key] = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, waiter.seq, key))
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
        """Try the parked polls again (after a state change), each queue in the order it was parked.

        While no ready slot may be handed out, every lone drafter's get_hs finds nothing, and finding
        nothing changes nothing; while no job is pending or no slot is free, every target's get_job
        does. Each of those queues asks that once (:class:`SharedWait`) and then waits without a look
        at each poll; it is asked again after each poll answered, so a slot freed or readied costs one
        try, not one for each parked poll. A group rank's get_hs shares its queue's look only while its
        group stands as it did at the poll's last try (:class:`RankWait`); a stale group's are each
        tried first."""
        for key, waiter in list(self._others.items()):
            self._try_again(key, waiter, now)
        for key, waiter in self._ranks.take_stale(self.core.groups.groups):
            self._try_again(key, waiter, now)
        for queue in self._shared:
            if queue.waiters:
                self._serve_shared(queue, now)

    def _serve_shared(self, queue: SharedWait, now: float) -> None:
        why = queue.why()  # asked before the queue is copied: it usually waits whole
        if why is None:
            for key, waiter in list(queue.waiters.items()):
                if self._try_again(key, waiter, now) and (why := queue.why()) is not None:
                    break
        if why is not None:
            queue.noted(why, self.core.workers, now)

    def _try_again(self, key: WaiterKey, waiter: Waiter, now: float) -> bool:
        """Whether the parked poll was answered (and left its queue)."""
        request_id = waiter.request.id
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
            for queue in self._shared:
                if key in queue.waiters:  # what it found nothing for may not be the queue's shared reason
                    queue.unnoted.add(key)
            return False
        self._remove(key)
        self.send(waiter.identity, reply)
        if self.loop_cpu is not None:
            self.loop_cpu.charge(messages.op_of(waiter.request))
        return True

    def expire(self, now: float) -> None:
        """Answer every poll past its deadline empty."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            waiter = self._parked(entry)
            if waiter is None:
                continue
            self._remove(entry[2])
            if waiter.worker_id not in self.core.workers:
                reply = counted_error(self.core, waiter.request.id, ErrorCode.UNKNOWN_WORKER,
                                      f"worker {waiter.worker_id} is not registered")
            else:
                reply = self._empty_reply(waiter.request)
            self.send(waiter.identity, reply)

    def drop(self, worker_id: str) -> None:
        """The worker left: its parked polls go unanswered."""
        for kind in (messages.GetJob, messages.GetHS, messages.JoinGroup):
            self._remove((worker_id, kind))

    def close(self) -> None:
        """The dispatcher stops: every parked poll is told so."""
        for waiter in self.waiters:
            self.send(waiter.identity, counted_error(self.core, waiter.request.id, ErrorCode.UNKNOWN_WORKER,
                                                     "the dispatcher is stopping"))
        for queue in self._shared:
            queue.clear()
        self._others, self._deadlines = {}, []
