"""The dispatcher's decisions, one method per protocol op, with no sockets and no clock of its own.

The socket loop (``dispatcher/server.py``) decodes a request, its handler (``dispatcher/handlers.py``)
calls the method of the same name here with ``now``, and the loop encodes what comes back.
Long-polls are the loop's business: ``get_job`` and ``get_hs`` answer None when nothing can be
handed out yet and the loop asks again after every state change. Everything a restart must know
goes through the journal before the method returns.

The core is composed of four parts, each given what it decides with:

- :class:`~dispatcher.registry.WorkerRegistry`: the sessions, their tokens and waits;
- :class:`~dispatcher.job_ops.JobOps`: jobs and slots between targets and drafters;
- :class:`~dispatcher.model_ops.ModelOps`: a model's steps, checkpoints and rollbacks;
- :class:`~dispatcher.group_ops.GroupOps`: data-parallel groups' versions and shares.

Here they are put together: registration, leaving, the sweep, and each op's checks that span them
(the run is done; a rank's version is current) before the part that decides it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np

from common.run.capture_contract import CaptureContract, adopt_contract
from common.run.descriptors import SlotExport
from common.run.records.events import (Checkpointed, DispatcherStarted, ModelRolledBack, StepCommitted, WorkerJoined,
                                       WorkerLeft)
from common.run.records.lengths import too_long_line, too_long_samples
from common.run.records.schedule import EpochSchedule
from common.wire.messages import GpuHealth, ModelClaim, ReadyReport, SlotCopies
from dispatcher.checkpoints import KnownCheckpoints
from dispatcher.core_types import DONE, STEP_FULL, CoreOptions, Counters, Incompatible, JobGrant, Worker
from dispatcher.epochs import EpochStore, check_data
from dispatcher.group_ops import GroupOps
from dispatcher.groups import DrafterGroups, Membership
from dispatcher.job_ops import JobOps
from dispatcher.journal import Journal
from dispatcher.ledger import Job, JobLedger, LedgerError
from dispatcher.model_ops import ModelOps
from dispatcher.pool import HSPool
from dispatcher.recovery import recover
from dispatcher.registry import WorkerRegistry
from dispatcher.schedule_builder import ScheduleSpec

log = logging.getLogger("hsd.dispatcher")



class DispatcherCore:
    def __init__(self, options: CoreOptions, *, run_dir, lengths, journal: Journal, pool: HSPool,
                 shared_slots: int, now: float):
        self.options = options
        self.run_dir = Path(run_dir)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.too_long = too_long_samples(self.lengths, options.buckets)  # no schedule places them
        if len(self.too_long):
            log.warning("%s", too_long_line(self.too_long, self.lengths, options.buckets[-1]))
        self.journal = journal
        self.pool = pool
        self.ledger = JobLedger(num_queues=max(1, options.num_target_queues))
        self.counters = Counters()
        self.started_at = now
        self.checkpoints = KnownCheckpoints(run_dir, journal)  # model -> step of its latest durable checkpoint
        self.contract = options.contract
        check_data(self.run_dir, self.lengths, allow_changed=options.allow_changed_data)
        self.checkpoints.refuse_unusable()
        self.store = EpochStore(self.run_dir, ScheduleSpec(tuple(options.buckets), options.tokens_per_batch,
                                                           options.run_seed, options.order, options.batching),
                                options.epochs, self.ledger, journal, build_ahead=options.build_ahead)
        recovered = recover(self.run_dir)
        self.incarnation = recovered.num_starts
        self.registry = WorkerRegistry(self.incarnation)
        self.workers: dict[str, Worker] = self.registry.workers
        self.groups = DrafterGroups(self.run_dir, self.incarnation, started_at=now,
                                    live_wait_s=options.worker_timeout_s)
        self.jobs = JobOps(options, lengths=self.lengths, ledger=self.ledger, pool=pool, store=self.store,
                           registry=self.registry, journal=journal, counters=self.counters, shared_slots=shared_slots)
        self.models = ModelOps(ledger=self.ledger, checkpoints=self.checkpoints, store=self.store, jobs=self.jobs,
                               registry=self.registry, journal=journal, counters=self.counters, started_at=now,
                               abandoned_after_s=options.abandoned_model_s)
        self.group_ops = GroupOps(groups=self.groups, ledger=self.ledger, checkpoints=self.checkpoints,
                                  registry=self.registry, jobs=self.jobs, models=self.models, journal=journal,
                                  is_done=lambda: self.done)
        self.step_costs = self.group_ops.step_costs  # model -> its group's cost per job (dispatcher.step_balance)
        self._recover(recovered)

    def _recover(self, recovered) -> None:
        """The ledger as the latest snapshot and the journal after it left it."""
        snapshot = recovered.snapshot
        if snapshot is not None:
            for model, record in sorted(snapshot.models.items(), key=lambda item: item[1].index):
                self.ledger.model_index[model] = record.index
                self.ledger.restore_model(model, record.step, record.last_commit)
                self.checkpoints[model] = record.checkpoint
        self.store.restore(recovered)
        for event in recovered.events:
            if isinstance(event, StepCommitted):
                self.ledger.restore_commit(event.model, event.step, event.jobs)
            elif isinstance(event, ModelRolledBack):  # as the live path: the known checkpoint never past the step
                self.ledger.rollback(event.model, event.step)
                self.checkpoints.lower_to(event.model, event.step)
            elif isinstance(event, Checkpointed):
                self.checkpoints[event.model] = max(self.checkpoints.get(event.model, 0), event.step)
        self.journal.record(DispatcherStarted(resumed=bool(recovered.epochs_started),
                                              committed=sum(p.committed for p in self.ledger.epochs.values())),
                            durable=True)
        self.store.settle(recovered)

    @property
    def epoch_jobs(self) -> dict[int, int]:
        """Every started epoch -> its job count."""
        return self.store.epoch_jobs

    def schedule(self, epoch: int) -> EpochSchedule:
        return self.store.schedule(epoch)

    @property
    def done(self) -> bool:
        """Every epoch committed, and every model's last commit covered by a checkpoint of it."""
        if not self.ledger.all_committed:  # the common answer, asked by every poll: O(1)
            return False
        return self.store.all_committed and self.models.all_checkpointed()

    @property
    def num_steps(self) -> int:
        """Optimizer steps the ledger holds, over every model."""
        return sum(self.ledger.model_step.values())

    @property
    def all_committed(self) -> bool:
        return self.store.all_committed

    def job_lengths(self, job_id_or_job: Job | int) -> np.ndarray:
        return self.jobs.job_lengths(job_id_or_job)

    def nothing_left_to_hand_out(self) -> bool:
        return self.jobs.nothing_left_to_hand_out()

    # -- snapshots --------------------------------------------------------------------------
    def maybe_snapshot(self, *, force: bool = False) -> bool:
        """Snapshot the ledger when it is due (see ``EpochStore.maybe_snapshot``)."""
        return self.store.maybe_snapshot(self.models.records, self.incarnation + 1, force=force)

    def close(self) -> None:
        if self.done:
            self.groups.remove_stores()
        self.store.close()

    # -- sessions ---------------------------------------------------------------------------
    def register(self, *, role: str, name: str, pid: int, host: str, gpu: int | None, now: float,
                 contract: CaptureContract | None = None, model: ModelClaim | None = None,
                 node: str | None = None, tp_ranks: list[tuple[int, int, int | None]] | None = None) -> Worker:
        """A new session. A drafter names its model and the step of the state it holds: the ledger
        rolls that model back to exactly that step (its later commits go back to pending)."""
        if contract is not None:
            try:
                first, self.contract = self.contract is None, adopt_contract(self.contract, contract,
                                                                             theirs_name=f"{role} {name}")
            except ValueError as exc:
                raise Incompatible(str(exc)) from None
            if first:
                log.info("capture contract of this run (from %s %s): %s", role, name, self.contract.to_dict())
        registered = self.group_ops.registered_model(role, model)
        model_id, model_step, spec = (registered.id, registered.step, registered.spec) if registered else (None, 0, None)
        if model_id is not None:
            if spec is None:  # a group's joiner takes a live rank's state instead
                self.models.check_not_ahead(model_id, model_step)
        worker_id = self.registry.new_id(role)
        for other in self.registry.sessions_of(name, role, host):
            self.deregister(other.id, now, reason="replaced")  # the same worker registering again
        worker = Worker(worker_id, role, name, pid, host, gpu, registered_at=now, last_seen=now,
                        token=self.registry.new_token(), model=model_id, node=node or host,
                        pending_committed=bool(registered and registered.pending_committed),
                        tp_ranks=list(tp_ranks or []))
        if spec is not None:
            try:
                self.groups.join(model_id, spec, worker_id, model_step, store_address=registered.store_address)
            except ValueError as exc:
                raise LedgerError(str(exc)) from None
        self.registry.add(worker)
        if role == "target" and self.options.num_target_queues:
            worker.queue = self.registry.free_queue(self.options.num_target_queues)
        self.journal.record(WorkerJoined(w=worker_id, role=role, name=name, pid=pid, host=host, node=worker.node,
                                         queue=worker.queue))
        if spec is not None:  # a rank's step matters only once a version names it (dispatcher/group_ops.py)
            self.group_ops.maybe_open(self.groups.groups[model_id], now)
        elif model_id is not None:
            self.models.rollback(model_id, model_step)
        if registered and registered.checkpoint:
            self.checkpoints.adopt(model_id, registered.checkpoint, ledger_step=self.ledger.model_step.get(model_id, 0),
                                   worker_id=worker_id, via="register")
        return worker

    def authenticate(self, worker_id: str, token: Any, now: float) -> Worker:
        return self.registry.authenticate(worker_id, token, now)

    def worker(self, worker_id: str, now: float, *, touch: bool = True) -> Worker:
        return self.registry.get(worker_id, now, touch=touch)

    def register_slots(self, worker_id: str, ipc_block: SlotExport, num_slots: int, now: float) -> None:
        self.jobs.register_slots(self.worker(worker_id, now), ipc_block, num_slots)

    def heartbeat(self, worker_id: str, now: float, holding: list[int] | None = None,
                  seen_grant: int | None = None, gpu: GpuHealth | None = None,
                  copies: SlotCopies | None = None) -> Worker:
        """Keeps the worker alive (leases are not renewed: a lease bounds one job's time); returns it.

        ``holding`` lists the jobs the worker holds and ``seen_grant`` the number of the latest grant
        it received. A job the ledger says it holds, granted no later than that, but not listed, was
        dropped or never reached it (a reply lost on a reset socket, which a later grant reveals): it
        is given back at once. Judging by grant numbers, not by time, a slow reply is never mistaken
        for a lost one."""
        worker = self.worker(worker_id, now)
        if gpu is not None:
            worker.gpu_health = gpu
        if copies is not None:
            worker.slot_copies = copies
        if holding is not None and seen_grant is not None:
            self.jobs.give_back_unlisted(worker_id, holding, seen_grant)
        return worker

    def deregister(self, worker_id: str, now: float, reason: str = "left") -> None:
        worker = self.worker(worker_id, now)
        self.registry.end_wait(worker, now)
        self.jobs.end_session(worker, reason)
        self.registry.remove(worker_id)
        self.journal.record(WorkerLeft(w=worker_id, reason=reason))
        if worker.model is not None:
            self.group_ops.rank_left(worker_id, now)

    def sweep(self, now: float, is_alive: Callable[[Worker], bool]) -> list[str]:
        """Declare silent or vanished workers dead and give back expired leases; returns the dead."""
        dead = [w.id for w in self.workers.values()
                if now - w.last_seen > self.options.worker_timeout_s or not is_alive(w)]
        for worker_id in dead:
            self.deregister(worker_id, now, reason="dead")
        self.jobs.expire_leases(now)
        self.models.find_unreported_checkpoints(now)
        return dead

    def end_wait(self, worker_id: str, now: float) -> None:
        if worker_id in self.workers:
            self.registry.end_wait(self.workers[worker_id], now)

    # -- targets ----------------------------------------------------------------------------
    def get_job(self, worker_id: str, now: float) -> JobGrant | str | None:
        worker = self.worker(worker_id, now)
        if self.done:
            self.registry.end_wait(worker, now)
            return DONE
        return self.jobs.take_pending(worker, now)

    def targets_wait(self) -> str | None:
        """Why every target's get_job finds nothing now (``starved``, ``blocked``), asked once for all
        of them; None when the run is done or some target may be served."""
        return None if self.done else self.jobs.why_no_target_is_served()

    def target_waits(self, worker_id: str, reason: str, now: float) -> None:
        """What a target's get_job that found nothing for ``reason`` leaves."""
        self.registry.wait(self.worker(worker_id, now), reason, now)

    def job_ready(self, worker_id: str, job_id: int, generation: int, busy_s: float, now: float) -> None:
        self.jobs.job_ready(self.worker(worker_id, now), job_id, generation, busy_s)

    def ready_with_poll(self, worker_id: str, reports: list[ReadyReport], now: float) -> int:
        return self.jobs.ready_with_poll(self.worker(worker_id, now), reports)

    def job_failed(self, worker_id: str, job_id: int, reason: str, now: float) -> None:
        self.worker(worker_id, now)
        self.jobs.job_failed(worker_id, job_id, reason)

    # -- drafters ---------------------------------------------------------------------------
    def get_hs(self, worker_id: str, now: float, *, membership: int | None = None) -> tuple[JobGrant | str | None, bool]:
        """(grant, flush): flush tells a waiting drafter to commit its partial step, nothing more is
        coming. STEP_FULL: a rank of a cost-balanced group holds its share of the step in flight."""
        worker = self.worker(worker_id, now)
        group = None
        if self.groups.group_of_rank(worker_id) is not None:  # a rank of a data-parallel group
            self.group_ops.step_boundary(worker_id, now)
            self.groups.check_current(worker_id, membership)
            group = self.groups.group_of(worker_id)
        if self.done:
            self.registry.end_wait(worker, now)
            return DONE, False
        if group is not None and group.spec.balance == "cost":
            if worker_id in group.full:
                return None, False  # its next poll, sent as it went to the all-reduce: served once the step commits
            if self.group_ops.has_its_share(group, worker_id):
                self.registry.end_wait(worker, now)
                return STEP_FULL, False
        return self.jobs.take_ready(worker, group, now)

    def lone_drafters_starved(self) -> bool:
        """Whether get_hs finds nothing now for every lone drafter: the run is not done and no ready
        slot may be handed out (what get_hs would find for each of them, asked once)."""
        return not self.done and not self.jobs.ready_servable()

    def starved(self, worker_id: str, now: float) -> None:
        """What a lone drafter's get_hs that found nothing since no slot may be handed out leaves."""
        self.registry.wait(self.worker(worker_id, now), "starved", now)

    def consumed(self, worker_id: str, job_id: int, now: float) -> None:
        self.jobs.consumed(self.worker(worker_id, now), job_id)

    def consumed_with_poll(self, worker_id: str, job_ids: list[int], now: float) -> int:
        return self.jobs.consumed_with_poll(self.worker(worker_id, now), job_ids)

    def read_failed(self, worker_id: str, job_id: int, reason: str, now: float) -> None:
        self.worker(worker_id, now)
        self.jobs.read_failed(worker_id, job_id, reason)

    def commit_step(self, worker_id: str, job_ids: list[int], busy_s: float, now: float, *, model: str | None = None,
                    step: int | None = None, verified: int = 0, metrics: dict[str, float] | None = None,
                    sync_wait_s: float = 0.0, step_s: float = 0.0, membership: int | None = None,
                    rank_jobs: list[int] | None = None, rank_busy_s: list[float] | None = None,
                    cost_jobs: list[int] | None = None) -> int:
        """The drafter's model takes optimizer step ``step`` on ``job_ids`` (see ModelOps.commit_step);
        a group's rank 0 commits it for the group, of its current version only."""
        worker = self.worker(worker_id, now)
        self.groups.check_current(worker_id, membership)
        group = self.groups.group_of(worker_id)
        step, new = self.models.commit_step(worker, group, job_ids, busy_s, model=model, step=step, verified=verified,
                                            metrics=metrics, sync_wait_s=sync_wait_s, step_s=step_s,
                                            rank_jobs=rank_jobs, rank_busy_s=rank_busy_s)
        if new and group is not None:
            self.group_ops.after_commit(group, list(job_ids if cost_jobs is None else cost_jobs), rank_jobs,
                                        rank_busy_s, now)
        return step

    def checkpoint(self, worker_id: str, step: int, now: float, *, model: str | None = None,
                   metrics: dict[str, float] | None = None) -> None:
        self.models.checkpoint(self.worker(worker_id, now), step, model=model, metrics=metrics)

    # -- groups -----------------------------------------------------------------------------
    def join_group(self, worker_id: str, now: float, *, after: int, step: int, failed: bool = False) -> Membership | None:
        return self.group_ops.join_group(worker_id, now, after=after, step=step, failed=failed)

    def step_outcome(self, worker_id: str, now: float, *, model: str, step: int, job_ids: list[int],
                     membership: int) -> bool:
        return self.group_ops.step_outcome(worker_id, now, model=model, step=step, job_ids=job_ids,
                                           membership=membership)

    def checkpoint_to_load(self, worker_id: str) -> int | None:
        return self.group_ops.checkpoint_to_load(worker_id)
