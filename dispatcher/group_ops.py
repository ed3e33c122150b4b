"""The core's ops for data-parallel drafter groups: ranks wait, versions open and end (see
:mod:`dispatcher.groups` for the rules), and the steps of a cost-balanced group are shared out. It
decides with the ledger, the jobs' and the models' ops it is given; like the core it has no sockets
and no clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from common.run.records.events import MembershipOpened
from common.wire.messages import GroupClaim, ModelClaim, PendingCommit
from common.wire.store_names import parse_store_address, store_address
from dispatcher.checkpoints import KnownCheckpoints
from dispatcher.groups import DrafterGroup, DrafterGroups, GroupSpec, Membership
from dispatcher.job_ops import JobOps
from dispatcher.journal import Journal
from dispatcher.ledger import JobLedger, LedgerError
from dispatcher.model_ops import ModelOps
from dispatcher.registry import WorkerRegistry
from dispatcher.step_balance import CostModel, has_its_share, job_features

log = logging.getLogger("hsd.dispatcher")


@dataclass(frozen=True)
class RegisteredModel:
    """A drafter's register ``model``, checked."""

    id: str
    step: int  # the step it holds once registered (its pending step included when that committed)
    spec: GroupSpec | None  # a rank of a data-parallel group (None: a lone drafter)
    store_address: str | None  # HOST:PORT of the TCPStore a rank hosts (None: FileStores)
    checkpoint: int  # the step of the durable checkpoint it holds
    pending_committed: bool  # the commit it never heard the answer to is in the ledger: it applies it


class GroupOps:
    def __init__(self, *, groups: DrafterGroups, ledger: JobLedger, checkpoints: KnownCheckpoints,
                 registry: WorkerRegistry, jobs: JobOps, models: ModelOps, journal: Journal,
                 is_done: Callable[[], bool]):
        self.groups = groups
        self.ledger = ledger
        self.checkpoints = checkpoints
        self.registry = registry
        self.jobs = jobs
        self.models = models
        self.journal = journal
        self._is_done = is_done  # the run's: no version opens once it is done
        self.step_costs: dict[str, CostModel] = {}  # model -> its group's cost per job (dispatcher.step_balance)

    def _group_spec(self, claim: GroupClaim | None) -> GroupSpec | None:
        """``model.group`` of a register request, checked against the rules a group's sizes follow
        (None: a lone drafter)."""
        if claim is None:
            return None
        spec = GroupSpec(size=claim.size, min_ranks=claim.min_ranks, max_ranks=claim.max_ranks, balance=claim.balance,
                         accum_steps=claim.accum_steps, elastic_batch=claim.elastic_batch)
        try:
            spec.check()
        except ValueError as exc:
            raise LedgerError(f"model.group: {exc}") from None
        return spec

    def registered_model(self, role: str, model: ModelClaim | None) -> RegisteredModel | None:
        """A register request's ``model`` (None for a worker that names none)."""
        if model is None:
            return None
        if role != "drafter":
            raise LedgerError("only a drafter registers a model")
        spec = self._group_spec(model.group)
        pending_committed = self._pending_committed(model.id, model.step, model.pending)
        return RegisteredModel(model.id, model.step + pending_committed, spec, self._rank_store(model.group),
                               model.checkpoint, pending_committed)

    def _pending_committed(self, model_id: str, model_step: int, pending: PendingCommit | None) -> bool:
        """``model.pending`` of a register: the commit a lone drafter (or a group's rank 0) sent and
        never heard the answer to (its dispatcher died). When the ledger holds exactly that commit the
        drafter applies it (its gradients are still there) and counts as holding that step, so the
        commit is not rolled back; otherwise it drops it."""
        if pending is None:
            return False
        return pending.step == model_step + 1 and self.ledger.last_commit.get(model_id) == (pending.step,
                                                                                            tuple(pending.job_ids))

    def _rank_store(self, claim: GroupClaim | None) -> str | None:
        """``model.group.store`` of a register request: HOST:PORT of the TCPStore the rank hosts
        (None: the group meets on FileStores in the run directory)."""
        value = claim.store if claim is not None else None
        return None if value is None else store_address(*parse_store_address(value))

    def _busy(self, group: DrafterGroup) -> bool:
        return any(self.ledger.held_by(w) for w in group.members)

    def maybe_open(self, group: DrafterGroup, now: float) -> None:
        """Open the group's next version when its rules allow it now (never once the run is done)."""
        if self._is_done():
            return
        ledger_step = self.ledger.model_step.get(group.model, 0)
        if not self.groups.may_open(group, busy=self._busy(group), ledger_step=ledger_step,
                                    checkpoint_step=self.checkpoints.get(group.model, 0), now=now):
            return
        opened = self.groups.open(group, ledger_step)
        for worker_id in opened.previous_members:  # what they hold belongs to a step that will not complete
            for job in self.ledger.held_by(worker_id):
                self.jobs.give_back(job, "membership_changed")
        if opened.rollback_to is not None or group.model not in self.ledger.model_index:
            # No rank holds the ledger's step (the whole group came back from a checkpoint), or the
            # model is new: the ledger takes the step of the state the group starts from.
            self.models.rollback(group.model, group.step)
        for worker_id, membership in group.memberships.items():
            self.registry.workers[worker_id].group = membership
        ranks = {self.registry.workers[w].name: r for w, r in group.members.items()}
        transfer = next(iter(group.memberships.values())).transfer
        log.info("model %s: membership %d opens at step %d with %d rank(s) %s%s", group.model, group.version,
                 group.step, len(ranks), ranks, " (the state goes out from rank 0)" if transfer else "")
        self.journal.record(MembershipOpened(model=group.model, version=group.version, step=group.step,
                                             ranks=list(group.members), transfer=transfer))

    def rank_left(self, worker_id: str, now: float) -> None:
        """A rank deregistered or died: when it was a member its version ends, and the next one opens
        with the others (when they are enough) at once."""
        group = self.groups.leave(worker_id)
        if group is not None:
            self._end_version(group, now)

    def _end_version(self, group: DrafterGroup, now: float, *, reopen: bool = True) -> None:
        ended = group.version
        for other in self.groups.end_version(group, self.ledger.model_step.get(group.model, 0)):
            self.registry.workers[other].group = None
            for job in self.ledger.held_by(other):  # the step in flight cannot complete
                self.jobs.give_back(job, "membership_changed")
        log.info("model %s: membership %d ended", group.model, ended)
        if reopen:
            self.maybe_open(group, now)

    def step_boundary(self, worker_id: str, now: float) -> None:
        """Before a member's next pull: waiting ranks join once no member holds a job."""
        group = self.groups.group_of(worker_id)
        if group is not None and group.waiting:
            self.maybe_open(group, now)

    def join_group(self, worker_id: str, now: float, *, after: int, step: int,
                   failed: bool = False) -> Membership | None:
        """The version that names ``worker_id``, newer than ``after`` (None: not yet; the loop asks again).

        ``step`` is the model step the rank holds now. ``failed``: a collective of version ``after``
        failed on this rank, so that version cannot step any more and ends now."""
        self.registry.get(worker_id, now)
        group = self.groups.group_of_rank(worker_id)
        if group is None:
            raise LedgerError(f"{worker_id} did not register as a rank of a data-parallel group")
        membership = group.memberships.get(worker_id)
        if membership is not None:
            # a rank that takes the state may hold any step; the source must hold the version's
            if group.version > after and (step == group.step or (membership.transfer and membership.rank != membership.source)):
                return membership
            if group.version > after or failed:  # it holds another step than the version's, or the version broke
                log.info("model %s: rank %d of membership %d %s", group.model, membership.rank, group.version,
                         "reports a failed collective" if failed else f"holds step {step}, not {group.step}")
                self._end_version(group, now, reopen=False)
            else:
                return None  # the version ends when the member that is leaving it deregisters
        self.groups.report_step(worker_id, step)
        self.maybe_open(group, now)
        membership = group.memberships.get(worker_id)
        return membership if membership is not None and group.version > after else None

    def step_outcome(self, worker_id: str, now: float, *, model: str, step: int, job_ids: list[int],
                     membership: int) -> bool:
        """Whether ``model`` committed ``step`` on exactly ``job_ids``: asked by a rank of version
        ``membership`` that could not receive the outcome from its rank 0 (dead inside its commit).
        That version ends now if it still stands, so a commit of it that had not landed yet never
        will (it is refused as from an ended version): the answer holds for good."""
        self.registry.get(worker_id, now)
        group = self.groups.group_of_rank(worker_id)
        if group is None or group.model != model:
            raise LedgerError(f"{worker_id} is not a rank of a group of model {model}")
        if group.version == membership and group.formed:
            log.info("model %s: rank %s of membership %d lost its rank 0's outcome of step %d", model,
                     group.members.get(worker_id), membership, step)
            self._end_version(group, now, reopen=False)  # its ranks report the step they hold, then it opens
        return self.ledger.last_commit.get(model) == (step, tuple(job_ids))

    # -- steps balanced by cost (dispatcher.step_balance) ------------------------------------------
    def job_features(self, job_id: int) -> np.ndarray:
        return job_features(self.jobs.job_lengths(job_id))

    def costs_of(self, model: str) -> CostModel:
        costs = self.step_costs.get(model)
        if costs is None:
            costs = self.step_costs[model] = CostModel()
        return costs

    def has_its_share(self, group: DrafterGroup, worker_id: str) -> bool:
        """Whether member ``worker_id`` of a cost-balanced group holds its share of the step in
        flight (it is then told so once; its next poll waits for the step to commit)."""
        held = {member: self.ledger.held_by(member) for member in group.members}
        remaining = group.step_jobs - sum(len(jobs) for jobs in held.values())
        costs = self.costs_of(group.model)
        loads = {member: sum(costs.estimate(self.job_features(job.job_id)) for job in jobs)
                 for member, jobs in held.items()}
        granted = sum(len(jobs) for jobs in held.values())
        job_cost = sum(loads.values()) / granted if granted else 1.0
        if not has_its_share(loads, worker_id, remaining=remaining, job_cost=job_cost,
                             open_ranks=len(group.members) - len(group.full)):
            return False
        group.full.add(worker_id)
        return True

    def _observe_step_costs(self, model: str, job_ids: list[int], rank_jobs: list[int] | None,
                            rank_busy_s: list[float] | None) -> None:
        """Rank 0 committed each rank's micro-batches of a step (``rank_jobs`` of ``job_ids`` each,
        in rank order; on a GPU an earlier step's, whose times are in by now) with each rank's busy
        seconds on them: observations of the cost model. Unknown job ids are left out."""
        if not rank_jobs or not rank_busy_s or len(rank_jobs) != len(rank_busy_s) or sum(rank_jobs) != len(job_ids):
            return
        costs = self.costs_of(model)
        start = 0
        for count, busy_s in zip(rank_jobs, rank_busy_s):
            if count:
                try:
                    costs.observe(sum(self.job_features(j) for j in job_ids[start:start + count]), busy_s)
                except (KeyError, IndexError, ValueError):  # a job id of no epoch this dispatcher holds
                    pass
            start += count

    def after_commit(self, group: DrafterGroup, job_ids: list[int], rank_jobs: list[int] | None,
                     rank_busy_s: list[float] | None, now: float) -> None:
        """A step of ``group`` committed: its shares start over, the cost model learns from its ranks'
        times, and waiting ranks join at this step boundary."""
        group.full = set()
        self._observe_step_costs(group.model, job_ids, rank_jobs, rank_busy_s)
        self.maybe_open(group, now)

    def checkpoint_to_load(self, worker_id: str) -> int | None:
        """For a waiting rank's empty ``join_group`` reply: the checkpoint it must load first (see
        :meth:`dispatcher.groups.DrafterGroups.checkpoint_to_load`): the newest whole one, which a
        rank reloading would find (never a damaged newer one it could not load)."""
        group = self.groups.group_of_rank(worker_id)
        if group is None:
            return None
        ledger_step = self.ledger.model_step.get(group.model, 0)
        return self.groups.checkpoint_to_load(worker_id, ledger_step,
                                              self.models.restart_step(group.model, ledger_step))
