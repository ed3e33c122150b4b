"""Commit, then apply: one path for a lone drafter and for every rank of a group.

One part of the drafter loop (:class:`drafter_worker.loop.DrafterLoop`), given what it uses. At a step boundary rank 0
(a lone drafter is rank 0 of its group of one) sends ``commit_step {model, step, job_ids}`` naming
every rank's jobs, with the figures of the step before (``metrics``, with the step they belong to:
they are known only once a step is applied). The outcome — committed, refused, aborted, or pending
(the dispatcher restarted before it answered) — goes to every rank (:meth:`share_outcome` of the
step group: a broadcast in a group, the identity alone), and every rank then applies the step or
drops it.

A commit that gets no reply is sent again while dispatcher.reconnect_s allows (it is idempotent). What a
commit that the dispatcher could not answer becomes is the one difference between the two, which
their step groups say (:mod:`drafter_worker.step_group`):

- a lone drafter's session ends with it (DispatcherGone, or WorkerLost when the dispatcher forgot
  it): its commit stays in flight, and the drafter keeps it pending across the restart (the step's
  gradients are kept), names it when it registers again and applies or drops it as the new
  dispatcher says (:meth:`StepCommits.settle_pending`). It may also keep a commit in flight while it copies
  its next slot: nobody waits for its outcome.
- rank 0's peers wait for the outcome in the broadcast that follows, so rank 0 turns every end
  into one (no dispatcher: aborted; one that forgot it: pending, which every rank keeps as above),
  and settles at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from common import faults
from common.wire import messages
from common.wire.messages import ErrorCode, ProtocolError
from common.worker.backends import DrafterBackend
from common.worker.gpu_health import ReportingSession
from common.worker.runtime import CALL_TIMEOUT_S, NoReply, WorkerLost, resend_until_answered
from drafter_worker.checkpointing import Checkpoints
from drafter_worker.step_group import (ABORTED, COMMITTED, PENDING, REFUSED, CollectiveFailed, DrafterState,
                                       LoneGroup, RankRound, RoundEnd)

if TYPE_CHECKING:
    from drafter_worker.elastic_group import ElasticGroup

log = logging.getLogger("hsd.drafter")


@dataclass(frozen=True)
class StepInFlight:
    """A step whose outcome is not yet applied: its commit (sent by rank 0 alone), this rank's jobs
    of it, the ranks' rounds it came from and the all-reduce wait."""

    request: messages.CommitStep
    request_id: int | None
    mine: list[int]
    rounds: list[RankRound]
    wait_s: float


class StepCommits:
    """The commit and settle path of ``backend``'s steps on ``session``, with the step ``group``
    (a :class:`~drafter_worker.step_group.LoneGroup` or an
    :class:`~drafter_worker.elastic_group.ElasticGroup`); the figures of a step come from
    ``checkpoints``, and a step kept across a dispatcher restart goes in ``state``. ``stopping``:
    whether the drafter was asked to stop; ``fault``: a test's kill point (:mod:`common.faults`)."""

    def __init__(self, *, name: str, session: ReportingSession, backend: DrafterBackend,
                 group: LoneGroup | ElasticGroup,
                 state: DrafterState, checkpoints: Checkpoints, stopping: Callable[[], bool],
                 fault: Callable[[str], None]):
        self.name, self.session, self.backend, self.group = name, session, backend, group
        self.state, self.checkpoints, self.stopping, self.fault = state, checkpoints, stopping, fault
        self.in_flight: StepInFlight | None = None  # the step whose outcome is not yet applied

    def send(self, job_ids: list[int], mine: list[int], rounds: list[RankRound], *, busy_s: float,
             wait_s: float) -> None:
        """The step on ``job_ids`` (``mine``: this rank's of them) is in flight from now; rank 0 sends its commit."""
        assert self.in_flight is None, "one commit in flight at a time"
        figures = self.checkpoints.figures_of(self.backend.step)  # the previous step's (this one: once acknowledged)
        request = messages.CommitStep(model=self.backend.model_id, step=self.backend.step + 1, job_ids=job_ids,
                                      verified=len(job_ids) if self.backend.verifies_slots else 0,
                                      metrics=figures or None,
                                      **self.group.commit_fields(rounds, busy_s=busy_s, wait_s=wait_s))
        request_id = self.session.submit(request) if self.group.rank == 0 else None
        self.in_flight = StepInFlight(request, request_id, list(mine), rounds, wait_s)

    def answered(self) -> bool:
        """Whether the commit in flight has its answer (rank 0's; another rank's has none to wait for)."""
        assert self.in_flight is not None
        return self.session.done(self.in_flight.request_id)

    def settle(self) -> RoundEnd | None:
        """The outcome of the step in flight on every rank: applied when committed, else dropped;
        the round it ends, when it ends one (none: no step in flight, or a group's refused step)."""
        step = self.in_flight
        if step is None:
            return None
        request = step.request
        job_ids = request.job_ids
        if self.group.rank == 0:
            outcome, after = self._outcome(request, step.request_id)
        else:
            outcome, after = ABORTED, self.group.version  # rank 0's comes in the broadcast
        self.in_flight = None
        if outcome == COMMITTED:
            self.fault("committed")
        elif outcome == PENDING:
            faults.delay_pending_outcome()
        try:
            outcome, after, failure = self.group.share_outcome(outcome, after, job_ids)
        except WorkerLost as exc:  # the dispatcher forgot this rank while it waited for the outcome
            outcome, failure = PENDING, exc
        self.session.held.discard(step.mine)  # the dispatcher holds them as committed, or took them back
        if outcome == PENDING:
            # Kept, not dropped, whichever rank learnt first that the dispatcher forgot it (rank 0 from
            # its commit, a peer from a refused heartbeat while it waited for the outcome): the
            # gradients are the group's, and the next dispatcher says whether the step committed.
            self.state.pending = messages.PendingCommit(step=request.step, job_ids=job_ids)
            if isinstance(failure, WorkerLost):
                raise failure
            raise WorkerLost(f"the dispatcher restarted before it answered the commit of step {request.step}") \
                from failure
        if failure is not None:
            if outcome == COMMITTED:  # durable, and the gradients are the group's: applied as on every rank
                self._apply(step)
            else:
                self.backend.drop_step()  # a rank that brought no jobs holds the summed gradients too
                if step.mine:
                    self.state.num_dropped_steps += 1
            raise failure
        if outcome != COMMITTED:
            self.backend.drop_step()
            self.state.num_dropped_steps += 1
            if outcome == ABORTED:
                raise CollectiveFailed(f"step {request.step} was not committed: the membership changed")
            return self.group.after_refusal(step.rounds, after)
        self._apply(step)
        return RoundEnd(step.rounds, stepped=True, after=after)

    def _outcome(self, request: messages.CommitStep, request_id: int | None) -> tuple[int, int]:
        """(outcome, the group's version after it) of rank 0's commit. A refusal (``bad_state``)
        drops the step on every rank. Any other end is the group's to judge
        (:meth:`~drafter_worker.step_group.LoneGroup.unanswered_commit`): a lone drafter raises it
        (its commit stays in flight: :meth:`lost` keeps it pending); rank 0's peers wait for an
        outcome: ABORTED (no dispatcher, or an error), PENDING (a dispatcher that forgot us)."""
        version = self.group.version
        try:
            reply = self._until_answered(request, request_id)
        except (NoReply, WorkerLost, ProtocolError) as exc:
            if isinstance(exc, ProtocolError) and exc.code == ErrorCode.BAD_STATE:
                log.warning("%s: step %d refused, dropped: %s", self.name, request.step, exc.message)
                return REFUSED, version
            return self.group.unanswered_commit(exc, request.step, self.stopping()), version
        return COMMITTED, version if reply.membership is None else reply.membership

    def _until_answered(self, request: messages.CommitStep, request_id: int | None = None) -> messages.CommitReply:
        """The reply to ``request`` (``request_id``: the one in flight), sent again while
        dispatcher.reconnect_s allows: at once when unanswered (a commit is idempotent), a second later when that
        dispatcher could not make it durable (``internal``: its journal failed and it stops; the same
        commit goes to the next one, which answers unknown_worker, and the step is dropped then).

        A lone drafter asked to stop sends it once: if that goes unanswered it drops the step and
        stops, saving what it applied (a dispatcher that did commit the step rolls the model back to
        that checkpoint), not dispatcher.reconnect_s later, when the other workers may have given up on a
        dispatcher that comes back only once this one has gone.

        One classification for a lone drafter and a group's rank 0; what the errors left mean is
        :meth:`_outcome`'s (NoReply once dispatcher.reconnect_s passed, ProtocolError: ``bad_state`` is
        a refusal, WorkerLost)."""
        step = request.step

        def again(exc: Exception) -> float | None:
            if isinstance(exc, NoReply):
                if not self.group.resends_commit(self.stopping()):
                    return None  # a stop is prompt: unanswered once it is asked, the step is dropped
                log.warning("%s: commit of step %d got no reply; sending it again", self.name, step)
                return 0.0
            if isinstance(exc, ProtocolError) and exc.code == ErrorCode.INTERNAL:
                log.warning("%s: commit of step %d failed (%s); sending it again", self.name, step, exc.message)
                return 1.0
            return None
        return resend_until_answered(lambda: self.session.submit(request),
                                     lambda request_id: self.session.result(request_id, timeout_s=CALL_TIMEOUT_S),
                                     again=again, request_id=request_id, deadline_s=self.session.reconnect_s)

    def _apply(self, step: StepInFlight) -> None:
        job_ids = step.request.job_ids
        metrics = self.backend.apply_step(job_ids)
        self.checkpoints.note_figures()
        self.group.applied(job_ids, metrics, busy_s=step.request.busy_s, wait_s=step.wait_s)

    # -- across a dispatcher restart --------------------------------------------------------------
    def lost(self, *, partial: bool) -> None:
        """The dispatcher forgot us. A commit in flight with no partial step after it (a lone
        drafter's) keeps its gradients, pending; else, with no pending step (a group's step the
        restarted dispatcher may hold is one), what was accumulated is dropped."""
        step, self.in_flight = self.in_flight, None
        state = self.state
        if step is not None and not partial:
            state.pending = messages.PendingCommit(step=step.request.step, job_ids=step.request.job_ids)
        if state.pending is None:
            if partial or step is not None:
                state.num_dropped_steps += 1
            self.backend.drop_step()

    def settle_pending(self, reply: messages.RegisterReply) -> None:
        """Apply the commit the last dispatcher never answered when the ledger holds it, else drop it."""
        state = self.state
        if state.pending is None:
            return
        pending, state.pending = state.pending, None
        self.session.held.discard(pending.job_ids)
        if reply.pending_committed:
            self.backend.apply_step(pending.job_ids)
            self.checkpoints.note_figures()
            log.info("%s: step %d, sent to the last dispatcher, committed: applied", self.name, pending.step)
        else:
            self.backend.drop_step()
            state.num_dropped_steps += 1
            log.info("%s: step %d, sent to the last dispatcher, did not commit: dropped", self.name, pending.step)
