"""The ranks that take a drafter's optimizer step together, as the one drafter loop sees them.

The loop (:mod:`drafter_worker.loop`) trains the same way whether it is alone or a rank of a
data-parallel group: it pulls micro-batches, and at the step boundary it meets the group (the
ranks exchange their job ids and flags), sums the gradients, has rank 0 commit the step, learns
the outcome and applies or drops the step. What the group is lives behind a *step group*:

- :class:`LoneGroup`: a lone drafter is a group of one. It joins no membership, meets at no
  rendezvous, opens no store and never starts ``torch.distributed``: its exchange is its own row,
  its gradients are already the step's, its commit's outcome is its own.
- :class:`drafter_worker.elastic_group.ElasticGroup`: a rank of an elastic group — membership
  versions asked of the dispatcher, a rendezvous and a ``torch.distributed`` group per version
  (:mod:`drafter_worker.process_group`), a state transfer to joiners, the outcome broadcast from
  rank 0. Imported only by a drafter that trains in a group.

Both take what they use — the session, the backend, the drafter section (a rank's), the busy clock
and the :class:`DrafterState` the loop's parts share — never the loop, and keep one interface:
``rank``, ``world_size``, ``version``; ``group_claim()`` (what ``register`` says of the group),
``poll_membership()`` (the version ``get_hs`` names), ``registered(reply)``; ``start(registration)``
and ``run_version(train)`` (train one version, or the lone drafter's one registration, and say how
it ended); what differs because a rank's peers wait for it and a lone drafter's do not
(``carries_consumed``, ``leave``, ``reports_before_round``, ``settles_now``, ``resends_commit``,
``unanswered_commit``, ``after_refusal``, ``idle_round``); the round's ``await_local_compute()``,
``measure_round(step, window)``, ``exchange(mine)``, ``sync_gradients(all_reduce)``,
``all_reduce(tensor)``, ``commit_fields(rounds, busy_s, wait_s)``, ``share_outcome(outcome, after,
job_ids)``; ``applied(...)`` and ``run_complete()`` (the log lines); ``close()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from common.wire import messages
from common.worker.backends import DrafterBackend
from common.worker.gpu_health import ReportingSession
from common.worker.runtime import NoReply
from drafter_worker.busy_clock import BusyClock

log = logging.getLogger("hsd.drafter")

# rank 0's commit outcome, shared with every rank (PENDING: the dispatcher restarted before it
# answered; every rank keeps the step and asks the next one when it registers)
COMMITTED, REFUSED, ABORTED, PENDING = 1, 0, -1, 2
RUN_DONE, NEXT_VERSION, LEAVE = "done", "next", "leave"  # how a version ends for a rank
GROUP_NEVER_FORMED_EXIT = 4  # exit code of a rank that found no version to train in within drafter.group_wait_s
# A micro-batch at least this long hides a get_hs round trip (0.1-1 ms between two processes, a few
# ms at the tail on a loaded two-core host): its poll can wait until the slot is copied out and
# carry the consumed report. A shorter one (a drafter that computes nothing) keeps its poll in flight
# during the copy instead, or it would wait a round trip for every slot.
CARRY_MIN_COMPUTE_S = 0.002


class CollectiveFailed(RuntimeError):
    """A collective of the group failed or timed out: a peer is gone."""


class GroupNeverFormed(RuntimeError):
    """No version to train in within ``drafter.group_wait_s``: peers are lost for good. The rank
    leaves (the dispatcher gives back whatever it held) and its process exits with an error."""


@dataclass(frozen=True)
class RankRound:
    """What every rank brings to a step: its job ids and what the dispatcher last told it."""

    rank: int
    job_ids: list[int]
    done: bool
    flush: bool
    busy_us: int = 0  # microseconds the rank computed on its micro-batches (the step's busy time)
    leaving: bool = False  # the rank leaves the group once this step ends (it was asked to stop)
    busy_step: int = 0  # the step busy_us was measured on (a GPU's figures come a step late; 0: none yet)


@dataclass
class DrafterState:
    """What the drafter loop's parts (the loop, its commits, checkpoints and step group) share about
    the model this process trains, beyond the backend's own state."""

    accum: int  # this rank's share of a step (the registration's, or its version's)
    checkpointed_step: int = 0  # the step of the latest checkpoint written or being written
    # a commit whose dispatcher died before it answered: its gradients are kept, and the next
    # register asks whether it committed (then it is applied, else dropped)
    pending: messages.PendingCommit | None = None
    num_dropped_steps: int = 0
    num_read_failures: int = 0


@dataclass(frozen=True)
class RoundEnd:
    """A round whose outcome is known: the ranks' rounds, whether a step was applied, and the
    group's version after it (what decides the checkpoints it calls for and how the version ends)."""

    rounds: list[RankRound]
    stepped: bool
    after: int


class LoneGroup:
    """A lone drafter as a group of one: every collective is the identity, nothing is opened. No
    peer waits for it: it may keep its commit in flight, and stops on its own."""

    rank, world_size, version = 0, 1, 0

    def __init__(self, *, name: str, session: ReportingSession, backend: DrafterBackend, state: DrafterState,
                 clock: BusyClock):
        self.name, self.session, self.backend, self.state, self.clock = name, session, backend, state, clock

    @staticmethod
    def group_claim() -> messages.GroupClaim | None:
        return None

    @staticmethod
    def poll_membership() -> int | None:
        return None

    def registered(self, reply: messages.RegisterReply) -> None:
        """The ledger holds the step this drafter registered at."""
        backend = self.backend
        ledger_step = backend.step if reply.model_step is None else reply.model_step
        if ledger_step != backend.step:
            raise RuntimeError(f"the dispatcher holds step {ledger_step} for model {backend.model_id}, "
                               f"which registered at step {backend.step}: the ledger did not roll back to it")

    def start(self, registration: messages.RegisterReply) -> None:
        self.state.accum = registration.accum_steps
        self.clock.discard_open()

    def run_version(self, train: Callable[[], str]) -> str:
        """One version: the registration's session (it ends with the run, a stop, or the session)."""
        return train()

    # -- what a drafter nobody waits for does -----------------------------------------------
    def carries_consumed(self, job: messages.Job | None, done: bool) -> bool:
        """Whether the next poll waits until ``job`` is copied out and carries its consumed report:
        when the compute hides a round trip, one message a slot."""
        clock = self.clock
        return job is not None and not done and (clock.cuda or clock.last_host_s >= CARRY_MIN_COMPUTE_S)

    @staticmethod
    def leave(drop_partial_step: Callable[[], None]) -> None:
        """Asked to stop: the partial step is dropped (its jobs go back)."""
        drop_partial_step()

    @staticmethod
    def reports_before_round(reports: list[int], collect: Callable[..., list[int]]) -> list[int]:
        """Its commit goes on the channel its consumed reports went ahead on: nothing to wait for."""
        return reports

    @staticmethod
    def settles_now(*, no_job: bool, flush: bool, done: bool, answered: Callable[[], bool]) -> bool:
        """Whether a commit just sent is settled at once; else the next slot is copied while it is in flight."""
        return no_job or flush or done or answered()

    @staticmethod
    def resends_commit(stopping: bool) -> bool:
        """A stop is prompt: a commit unanswered once it is asked is dropped, not sent again."""
        return not stopping

    def unanswered_commit(self, exc: Exception, step: int, stopping: bool) -> int:
        """What a commit that got no answer becomes: the session ends with it (its commit stays in
        flight, and the loop keeps it pending), unless asked to stop (dropped: REFUSED)."""
        if not isinstance(exc, NoReply):
            raise exc
        if stopping:
            log.warning("%s: commit of step %d unanswered and asked to stop: dropped (a dispatcher that did "
                        "commit it rolls the model back to its checkpoint)", self.name, step)
            return REFUSED
        raise self.session.gone(f"commit of step {step} unanswered") from None

    @staticmethod
    def after_refusal(rounds: list[RankRound], after: int) -> RoundEnd | None:
        """A refused step ends the round: nothing else will."""
        return RoundEnd(rounds, stepped=False, after=after)

    @staticmethod
    def idle_round(stepped: bool) -> bool:
        """Whether a round may save and end the run on a ``flush``/``done``: every one (it has no
        other rank to hold the round after its last step with)."""
        return True

    # -- a round ------------------------------------------------------------------------------
    def await_local_compute(self) -> None:
        """Nothing to wait for: no peer's time is measured against this drafter's queue."""

    def measure_round(self, step: int, window: list[int]) -> tuple[int, float]:
        """(the step measured, its compute seconds): the micro-batches of ``step``, and every step
        before it whose work completed since (on a GPU a step's figure comes late: none is lost)."""
        if not window:
            return 0, 0.0
        self.clock.close_step(step)
        return step, sum(seconds for _, seconds in self.clock.completed())

    @staticmethod
    def exchange(mine: RankRound) -> list[RankRound]:
        return [mine]

    @staticmethod
    def sync_gradients(all_reduce: Callable[[Any], None]) -> None:
        """One rank: its gradients are the step's."""

    def all_reduce(self, tensor: Any) -> None:
        raise AssertionError("a lone drafter sums nothing")

    @staticmethod
    def commit_fields(rounds: list[RankRound], *, busy_s: float, wait_s: float) -> dict[str, Any]:
        return {"busy_s": busy_s}

    @staticmethod
    def share_outcome(outcome: int, after: int, job_ids: list[int]) -> tuple[int, int, Exception | None]:
        return outcome, after, None

    def applied(self, job_ids: list[int], metrics: dict[str, Any], *, busy_s: float, wait_s: float) -> None:
        log.debug("%s: step %d  %d jobs  %.3fs  %s", self.name, self.backend.step, len(job_ids), busy_s, metrics)

    def run_complete(self) -> None:
        state = self.state
        log.info("%s: run complete, model %s at step %d (%d steps dropped, %d stale reads)", self.name,
                 self.backend.model_id, self.backend.step, state.num_dropped_steps, state.num_read_failures)

    def close(self) -> None:
        """Nothing was opened."""
