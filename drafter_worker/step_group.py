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

The interface both keep: ``lone``, ``rank``, ``world_size``, ``version``; ``group_claim()`` (what
``register`` says of the group) and ``poll_membership()`` (the version ``get_hs`` names); ``start(registration)``
and ``run_version(train)`` (train one version, or the lone drafter's one registration, and say how
it ended); ``await_local_compute()``, ``measure_round(clock, step, window)``, ``exchange(mine)``,
``sync_gradients(backend, all_reduce)``, ``all_reduce(tensor)``, ``commit_fields(rounds, busy_s,
wait_s)``, ``share_outcome(outcome, after, job_ids)``; ``applied(...)`` and ``run_complete()`` (the
log lines); ``close()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from common.wire import messages
from drafter_worker.busy_clock import BusyClock

log = logging.getLogger("hsd.drafter")

# rank 0's commit outcome, shared with every rank (PENDING: the dispatcher restarted before it
# answered; every rank keeps the step and asks the next one when it registers)
COMMITTED, REFUSED, ABORTED, PENDING = 1, 0, -1, 2
RUN_DONE, NEXT_VERSION, LEAVE = "done", "next", "leave"  # how a version ends for a rank
GROUP_NEVER_FORMED_EXIT = 4  # exit code of a rank that found no version to train in within drafter.group_wait_s


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


class LoneGroup:
    """A lone drafter as a group of one: every collective is the identity, nothing is opened."""

    lone = True  # no peer waits for this drafter: it may keep its commit in flight, and stops on its own
    rank, world_size, version = 0, 1, 0

    def __init__(self, loop: Any):
        self.loop = loop

    @staticmethod
    def group_claim() -> messages.GroupClaim | None:
        return None

    @staticmethod
    def poll_membership() -> int | None:
        return None

    def start(self, registration: messages.RegisterReply) -> None:
        self.loop.accum = registration.accum_steps
        self.loop.clock.discard_open()

    def run_version(self, train: Callable[[], str]) -> str:
        """One version: the registration's session (it ends with the run, a stop, or the session)."""
        return train()

    def await_local_compute(self) -> None:
        """Nothing to wait for: no peer's time is measured against this drafter's queue."""

    @staticmethod
    def measure_round(clock: BusyClock, step: int, window: list[int]) -> tuple[int, float]:
        """(the step measured, its compute seconds): the micro-batches of ``step``, and every step
        before it whose work completed since (on a GPU a step's figure comes late: none is lost)."""
        if not window:
            return 0, 0.0
        clock.close_step(step)
        return step, sum(seconds for _, seconds in clock.completed())

    @staticmethod
    def exchange(mine: RankRound) -> list[RankRound]:
        return [mine]

    @staticmethod
    def sync_gradients(backend: Any, all_reduce: Callable[[Any], None]) -> None:
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
        loop = self.loop
        log.debug("%s: step %d  %d jobs  %.3fs  %s", loop.name, loop.backend.step, len(job_ids), busy_s, metrics)

    def run_complete(self) -> None:
        loop = self.loop
        log.info("%s: run complete, model %s at step %d (%d steps dropped, %d stale reads)", loop.name,
                 loop.backend.model_id, loop.backend.step, loop.num_dropped_steps, loop.num_read_failures)

    def close(self) -> None:
        """Nothing was opened."""
