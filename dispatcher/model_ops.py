"""The core's model ops: a drafter's optimizer steps and checkpoints, and rolling a model back to the
step a drafter restarts from. A step is committed all or nothing, journaled durably before the
dispatcher answers; a checkpoint report makes the model's steps up to it count as durable.

No sockets and no clock; the group side of a step (the version it belongs to, what opens after it)
is :class:`dispatcher.group_ops.GroupOps`'.
"""

from __future__ import annotations

import logging

from common.run.records.events import Checkpointed, EpochCommitted, ModelRolledBack, StepCommitted
from dispatcher.checkpoints import KnownCheckpoints
from dispatcher.core_types import Counters, Worker
from dispatcher.epochs import EpochStore
from dispatcher.groups import DrafterGroup
from dispatcher.job_ops import JobOps
from dispatcher.journal import Journal
from dispatcher.ledger import JobLedger, JobState, LedgerError
from dispatcher.recovery import ModelRecord
from dispatcher.registry import WorkerRegistry

log = logging.getLogger("hsd.dispatcher")


class ModelOps:
    def __init__(self, *, ledger: JobLedger, checkpoints: KnownCheckpoints, store: EpochStore, jobs: JobOps,
                 registry: WorkerRegistry, journal: Journal, counters: Counters, started_at: float,
                 abandoned_after_s: float):
        self.started_at = started_at
        self.abandoned_after_s = abandoned_after_s  # dispatcher.abandoned_model_s
        self.last_live: dict[str, float] = {}  # model -> when a live drafter last trained it (sweep time)
        self.ledger = ledger
        self.counters = counters
        self.checkpoints = checkpoints
        self.store = store
        self.jobs = jobs
        self.registry = registry
        self.journal = journal

    def check_not_ahead(self, model: str, step: int) -> None:
        held = self.ledger.model_step.get(model, 0)
        if step > held:
            raise LedgerError(f"model {model} holds step {step}, ahead of the ledger's {held}: its last "
                              f"commit never became durable; reload its latest checkpoint and register again")

    def rollback(self, model: str, step: int, *, cause: str = "restart") -> None:
        """The model restarts from ``step``: its later commits go back to pending, and what another
        session of it consumed and did not commit is void. ``cause``: "restart" (a drafter registered
        from that checkpoint) or "abandoned" (:meth:`find_unreported_checkpoints`)."""
        for worker in self.registry.of_model(model):
            for job in self.ledger.held_by(worker.id):
                if job.state is JobState.CONSUMED:
                    self.jobs.give_back(job, "model_rolled_back")
        if self.ledger.model_step.get(model, 0) == step and model in self.ledger.model_index:
            return
        reverted = self.ledger.rollback(model, step)
        self.checkpoints.lower_to(model, step)
        # Every rollback is a restart from a checkpoint: a lone drafter's, a group's none of whose
        # live ranks held the committed step (a membership change itself never rolls back), or an
        # abandoned model's, whose steps past its checkpoint no drafter will ever bring back.
        self.journal.record(ModelRolledBack(model=model, step=step, jobs=len(reverted), cause=cause), durable=True)
        if reverted:
            log.info("model %s %s at step %d: %d job(s) committed after it go back to pending", model,
                     "registered" if cause == "restart" else "goes back to its checkpoint", step, len(reverted))

    def commit_step(self, worker: Worker, group: DrafterGroup | None, job_ids: list[int], busy_s: float, *,
                    model: str | None, step: int | None, verified: int, metrics: dict[str, float] | None,
                    sync_wait_s: float, step_s: float, rank_jobs: list[int] | None,
                    rank_busy_s: list[float] | None) -> tuple[int, bool]:
        """(step, new): the model takes optimizer step ``step`` on ``job_ids`` (new: False for a retry
        of a commit whose reply was lost, which gets the same answer). Refused, all or nothing, when
        a job is not consumed by the drafter (any current member, for a group's) or the step does not
        follow the model's last."""
        model = model or worker.model or worker.id
        if group is not None and model != group.model:
            raise LedgerError(f"{worker.id} trains model {group.model}, not {model}")
        holders = set(group.members) if group is not None else {worker.id}
        stepper: Worker | DrafterGroup = group or worker
        if step is None:
            step = self.ledger.model_step.get(model, 0) + 1
        if not job_ids:
            raise LedgerError("a step must hold at least one job")
        if self.ledger.last_commit.get(model) == (step, tuple(job_ids)):
            return step, False
        try:
            jobs = self.ledger.commit(job_ids, worker.id, model, step, holders=holders)
        except LedgerError:
            # All or nothing: the drafter drops the step (its gradients), so what it still holds of it is redone.
            for job_id in job_ids:
                job = self.ledger.jobs.get(job_id)
                if job is not None and job.state is JobState.CONSUMED and job.holder in holders:
                    self.jobs.give_back(job, "step_refused")
            raise
        num_tokens = sum(self.jobs.num_tokens(j) for j in jobs)
        record = StepCommitted(model=model, step=step, jobs=list(job_ids), w=worker.id,
                               buckets=sorted({j.bucket for j in jobs}), avail=stepper.window_avail,
                               mixed=stepper.window_mixed, tokens=num_tokens, busy_s=round(busy_s, 6),
                               verified=verified)
        if metrics and "step" in metrics:  # the figures of that step (the drafter's previous one)
            record.metrics = {**metrics, "step": int(metrics["step"])}
        if group:
            record.membership = group.version
            record.sync_wait_s, record.step_s = round(sync_wait_s, 6), round(step_s, 6)
            if rank_busy_s and rank_jobs:
                record.rank_jobs, record.rank_busy_s = list(rank_jobs), [round(b, 6) for b in rank_busy_s]
        self.journal.record(record, durable=True)
        self.counters.steps += 1
        self.counters.mixed_steps += stepper.window_mixed
        stepper.window_avail, stepper.window_mixed = None, True
        if metrics:
            worker.metrics = {k: v for k, v in metrics.items() if k != "step"}
        worker.num_jobs += len(jobs)
        worker.num_tokens += num_tokens
        for epoch in sorted({j.epoch for j in jobs}):
            if self.ledger.epoch_complete(epoch):
                self.journal.record(EpochCommitted(epoch=epoch), durable=True)
                self.store.finish_if_complete(epoch)
        return step, True

    def checkpoint(self, worker: Worker, step: int, *, model: str | None, metrics: dict[str, float] | None) -> None:
        """The model's state at ``step`` (its witness included) is durable on disk; ``metrics``: that
        step's figures (the last step's reach the journal this way: no commit follows it)."""
        model = model or worker.model or worker.id
        held = self.ledger.model_step.get(model, 0)
        if step > held:
            raise LedgerError(f"model {model}: checkpoint of step {step} is ahead of the ledger's {held}")
        self.checkpoints[model] = max(self.checkpoints.get(model, 0), step)
        self.journal.record(Checkpointed(model=model, step=step, w=worker.id,
                                         metrics={**metrics, "step": step} if metrics else None), durable=True)

    def find_unreported_checkpoints(self, now: float) -> None:
        """Once every job is committed, a model whose known checkpoint lags its step and that no live
        drafter trains may still have its last checkpoint on disk: written by a drafter whose report
        found no dispatcher, and which is not coming back to say so when it registers.

        A model whose checkpoint still lags its step once no drafter has trained it for
        ``abandoned_after_s`` (``dispatcher.abandoned_model_s``) is abandoned: the steps past that
        checkpoint live in no state that will come back (its drafter stopped without knowing whether
        its last commit held, or died), so the run would wait for it forever. It goes back to
        :meth:`restart_step` and the jobs of the later steps to pending, for the live drafters to
        train; a drafter of it that does come back later registers from that checkpoint as after
        any restart. A model lost before its first checkpoint goes back to step 0 the same way."""
        live = self.registry.models()
        for model in live:
            self.last_live[model] = now
        if not self.store.all_committed:
            return
        for model, step in list(self.ledger.model_step.items()):
            if self.checkpoints.get(model, 0) < step and model not in live:
                back_to = self.restart_step(model, step)
                if back_to < step and now - self.last_live.get(model, self.started_at) >= self.abandoned_after_s:
                    log.warning("model %s: no drafter has trained it for %.0fs and %s, behind its step %d: it goes "
                                "back there", model, self.abandoned_after_s,
                                f"its checkpoint is at step {back_to}" if back_to else "it has no checkpoint (step 0)",
                                step)
                    self.rollback(model, back_to, cause="abandoned")

    def restart_step(self, model: str, step: int) -> int:
        """The step a drafter resuming ``model`` (at ``step`` in the ledger) would start from: its
        newest whole checkpoint in this run directory (one found there that the dispatcher was not
        told of is adopted; 0 when every one there is damaged), else the newest it was told of (a
        group whose rank 0 keeps them on another node), 0 when it has none."""
        on_disk = self.checkpoints.on_disk(model) if self.checkpoints.holds_model(model) else None
        if on_disk:
            self.checkpoints.adopt(model, on_disk, ledger_step=step, worker_id=None, via="disk")
        known = self.checkpoints.get(model, 0)
        return known if on_disk is None else min(known, on_disk)

    def all_checkpointed(self) -> bool:
        """Every model's last commit is covered by a checkpoint of it."""
        return all(self.checkpoints.get(m, 0) >= step for m, step in self.ledger.model_step.items())

    def records(self) -> dict[str, ModelRecord]:
        """What a ledger snapshot keeps of each model."""
        ledger = self.ledger
        return {m: ModelRecord(index=i, step=ledger.model_step.get(m, 0), checkpoint=self.checkpoints.get(m, 0),
                               last_commit=ledger.last_commit.get(m)) for m, i in ledger.model_index.items()}
