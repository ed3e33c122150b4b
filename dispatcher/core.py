"""The dispatcher's decisions, one method per protocol op, with no sockets and no clock of its own.

The socket loop (``dispatcher/server.py``) decodes a request, calls the method of the same name
here with ``now``, and encodes what comes back. Long-polls are the loop's business: ``get_job``
and ``get_hs`` answer None when nothing can be handed out yet and the loop asks again after every
state change. Everything a restart must know goes through the journal before the method returns.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from common.run.capture_contract import adopt_contract
from dispatcher.checkpoints import KnownCheckpoints
from dispatcher.core_types import (DONE, STEP_FULL, CoreOptions, Counters, Incompatible, JobGrant, Unauthorized,
                                   UnknownWorker, Worker)
from dispatcher.group_ops import GroupOps
from dispatcher.groups import DrafterGroup, DrafterGroups
from dispatcher.journal import Journal
from dispatcher.ledger import Job, JobLedger, JobState, LedgerError, split_job_id
from dispatcher.epochs import EpochStore, check_data
from dispatcher.pool import HSPool
from dispatcher.recovery import ModelRecord, recover
from dispatcher.schedule import EpochSchedule
from dispatcher.schedule_builder import ScheduleSpec
from dispatcher.step_balance import CostModel

log = logging.getLogger("hsd.dispatcher")



class DispatcherCore(GroupOps):
    def __init__(self, options: CoreOptions, *, run_dir, lengths, journal: Journal, pool: HSPool,
                 shared_slots: int, now: float):
        self.options = options
        self.run_dir = Path(run_dir)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.journal = journal
        self.pool = pool
        self.ledger = JobLedger(num_queues=max(1, options.num_target_queues))
        self.workers: dict[str, Worker] = {}
        self.counters = Counters()
        self.started_at = now
        self.checkpoints = KnownCheckpoints(run_dir, journal)  # model -> step of its latest durable checkpoint
        self.step_costs: dict[str, CostModel] = {}  # model -> its group's cost per job (dispatcher.step_balance)
        self.contract = options.contract
        self._next_worker = Counter()
        self._next_slot_id = shared_slots
        pool.add_slots(range(shared_slots))
        check_data(self.run_dir, self.lengths, allow_changed=options.allow_changed_data)
        self.store = EpochStore(self.run_dir, ScheduleSpec(tuple(options.buckets), options.tokens_per_batch,
                                                           options.run_seed, options.order, options.batching),
                                options.epochs, self.ledger, journal, build_ahead=options.build_ahead)
        self.groups: DrafterGroups | None = None  # made once the incarnation is known (_recover)
        self._recover()

    def _recover(self) -> None:
        """The ledger as the latest snapshot and the journal after it left it."""
        recovered = recover(self.run_dir)
        self.incarnation = recovered.num_starts
        self.groups = DrafterGroups(self.run_dir, self.incarnation, started_at=self.started_at,
                                    live_wait_s=self.options.worker_timeout_s)
        snapshot = recovered.snapshot
        if snapshot is not None:
            for model, record in sorted(snapshot.models.items(), key=lambda item: item[1].index):
                self.ledger.model_index[model] = record.index
                self.ledger.restore_model(model, record.step, record.last_commit)
                self.checkpoints[model] = record.checkpoint
        self.store.restore(recovered)
        for event in recovered.events:
            kind = event["ev"]
            if kind == "commit":
                self.ledger.restore_commit(event["model"], event["step"], event["jobs"])
            elif kind == "rollback":  # as the live path (_rollback): the known checkpoint never past the step
                self.ledger.rollback(event["model"], event["step"])
                self.checkpoints.lower_to(event["model"], event["step"])
            elif kind == "checkpoint":
                self.checkpoints[event["model"]] = max(self.checkpoints.get(event["model"], 0), event["step"])
        self.journal.record("start", durable=True, resumed=bool(recovered.epochs_started),
                            committed=sum(p.committed for p in self.ledger.epochs.values()))
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
        return (self.store.all_committed
                and all(self.checkpoints.get(m, 0) >= step for m, step in self.ledger.model_step.items()))

    @property
    def num_steps(self) -> int:
        """Optimizer steps the ledger holds, over every model."""
        return sum(self.ledger.model_step.values())

    @property
    def all_committed(self) -> bool:
        return self.store.all_committed

    def _grant(self, job: Job, slot_id: int) -> JobGrant:
        facts = job.grant
        if facts is None:  # its samples, their lengths, the padded length and the tokens: read once per job
            schedule = self.schedule(job.epoch)
            samples = schedule.sample_array(split_job_id(job.job_id)[1])
            lengths = self.lengths[samples].tolist()
            facts = job.grant = (samples.tolist(), lengths, schedule.padded_len(job.bucket, lengths), sum(lengths))
        samples, lengths, seq_len, _ = facts
        owner = self.pool.slots[slot_id].owner
        base = self.workers[owner].slot_base if owner else 0
        holder = self.workers[job.holder]
        holder.num_grants += 1
        job.grant_seq = holder.num_grants
        return JobGrant(job, slot_id - base, owner, seq_len, samples, lengths, job.grant_seq)

    # -- snapshots --------------------------------------------------------------------------
    def maybe_snapshot(self, *, force: bool = False) -> bool:
        """Snapshot the ledger when it is due (see ``EpochStore.maybe_snapshot``)."""
        ledger = self.ledger
        models = {m: ModelRecord(index=i, step=ledger.model_step.get(m, 0), checkpoint=self.checkpoints.get(m, 0),
                                 last_commit=ledger.last_commit.get(m)) for m, i in ledger.model_index.items()}
        return self.store.maybe_snapshot(models, self.incarnation + 1, force=force)

    def close(self) -> None:
        if self.done:
            self.groups.remove_stores()
        self.store.close()

    # -- membership -------------------------------------------------------------------------
    def register(self, *, role: str, name: str, pid: int, host: str, gpu: int | None, now: float,
                 contract: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
                 node: str | None = None) -> Worker:
        """A new session. A drafter names its model and the step of the state it holds: the ledger
        rolls that model back to exactly that step (its later commits go back to pending)."""
        if contract is not None:
            try:
                first, self.contract = self.contract is None, adopt_contract(self.contract, contract,
                                                                             theirs_name=f"{role} {name}")
            except ValueError as exc:
                raise Incompatible(str(exc)) from None
            if first:
                log.info("capture contract of this run (from %s %s): %s", role, name, self.contract)
        registered = self._registered_model(role, model)
        model_id, model_step, spec = (registered.id, registered.step, registered.spec) if registered else (None, 0, None)
        if model_id is not None:
            held = self.ledger.model_step.get(model_id, 0)
            if model_step > held and spec is None:  # a group's joiner takes a live rank's state instead
                raise LedgerError(f"model {model_id} holds step {model_step}, ahead of the ledger's {held}: its last "
                                  f"commit never became durable; reload its latest checkpoint and register again")
        # The incarnation keeps ids unique across dispatcher restarts: a worker still speaking for
        # the previous dispatcher's "d0" must get unknown_worker, not the new d0's jobs.
        worker_id = f"{role[0]}{self._next_worker[role]}.{self.incarnation}"
        self._next_worker[role] += 1
        for other in [w for w in self.workers.values() if w.name == name and w.role == role and w.host == host]:
            self.deregister(other.id, now, reason="replaced")  # the same worker registering again
        worker = Worker(worker_id, role, name, pid, host, gpu, registered_at=now, last_seen=now,
                        token=secrets.token_hex(16), model=model_id, node=node or host,
                        pending_committed=bool(registered and registered.pending_committed))
        if spec is not None:
            try:
                self.groups.join(model_id, spec, worker_id, model_step, store_address=registered.store_address)
            except ValueError as exc:
                raise LedgerError(str(exc)) from None
        self.workers[worker_id] = worker
        extra = {}
        if role == "target" and self.options.num_target_queues:
            worker.queue = self._free_queue()
            extra["queue"] = worker.queue
        self.journal.record("join", w=worker_id, role=role, name=name, pid=pid, host=host, node=worker.node, **extra)
        if spec is not None:  # a rank's step matters only once a version names it (dispatcher/group_ops.py)
            self._maybe_open(self.groups.groups[model_id], now)
        elif model_id is not None:
            self._rollback(model_id, model_step)
        if registered and registered.checkpoint:
            self.checkpoints.adopt(model_id, registered.checkpoint, ledger_step=self.ledger.model_step.get(model_id, 0),
                                   worker_id=worker_id, via="register")
        return worker

    def _free_queue(self) -> int | None:
        """Per-target assignment: the lowest queue no live target takes from (None: every queue has one)."""
        taken = {w.queue for w in self.workers.values() if w.queue is not None}
        return next((k for k in range(self.options.num_target_queues) if k not in taken), None)

    def _rollback(self, model: str, step: int) -> None:
        for worker in self.workers.values():  # another session of this model: its uncommitted work is void
            if worker.model == model:
                for job in self.ledger.held_by(worker.id):
                    if job.state is JobState.CONSUMED:
                        self._give_back(job, "model_rolled_back")
        if self.ledger.model_step.get(model, 0) == step and model in self.ledger.model_index:
            return
        reverted = self.ledger.rollback(model, step)
        self.checkpoints.lower_to(model, step)
        # Every rollback is a restart from a checkpoint: a lone drafter's, or a group's none of whose
        # live ranks held the committed step (a membership change itself never rolls back).
        self.journal.record("rollback", durable=True, model=model, step=step, jobs=len(reverted), cause="restart")
        if reverted:
            log.info("model %s registered at step %d: %d job(s) committed after it go back to pending",
                     model, step, len(reverted))

    def authenticate(self, worker_id: str, token: Any, now: float) -> Worker:
        worker = self.worker(worker_id, now, touch=False)
        if not isinstance(token, str) or not secrets.compare_digest(token, worker.token):
            raise Unauthorized(f"request for {worker_id} without its session token")
        worker.last_seen = now
        return worker

    def register_slots(self, worker_id: str, ipc_block: dict[str, Any], num_slots: int, now: float) -> None:
        """A cuda_ipc or nixl target's own slots join the pool; drafters get ``ipc_block`` to open them.
        nixl slots live on the target's node (cuda_ipc ones on the dispatcher's, as every worker)."""
        worker = self.worker(worker_id, now)
        if worker.role != "target" or worker.ipc_block is not None:
            raise LedgerError(f"{worker_id} cannot register slots (not a target, or registered them already)")
        if num_slots <= 0:
            raise LedgerError("num_slots must be positive")
        worker.ipc_block, worker.slot_base = ipc_block, self._next_slot_id
        self._next_slot_id += num_slots
        self.pool.add_slots(range(worker.slot_base, worker.slot_base + num_slots), owner=worker_id,
                            node=worker.node if ipc_block.get("kind") == "nixl" else None)
        if self.pool.effective_min_ready < self.pool.min_ready:
            log.warning("pool.min_ready=%d cannot be reached with the %d slot(s) live targets registered (and "
                        "pool.target_credits=%d): drafters are served from %d ready slot(s)", self.pool.min_ready,
                        len(self.pool.slots), self.pool.target_credits, self.pool.effective_min_ready)

    def worker(self, worker_id: str, now: float, *, touch: bool = True) -> Worker:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(worker_id)
        if touch:
            worker.last_seen = now
        return worker

    def heartbeat(self, worker_id: str, now: float, holding: list[int] | None = None,
                  seen_grant: int | None = None) -> None:
        """Keeps the worker alive (leases are not renewed: a lease bounds one job's time).

        ``holding`` lists the jobs the worker holds and ``seen_grant`` the number of the latest grant
        it received. A job the ledger says it holds, granted no later than that, but not listed, was
        dropped or never reached it (a reply lost on a reset socket, which a later grant reveals): it
        is given back at once. Judging by grant numbers, not by time, a slow reply is never mistaken
        for a lost one."""
        self.worker(worker_id, now)
        if holding is None or seen_grant is None:
            return
        listed = set(holding)
        for job in self.ledger.held_by(worker_id):
            if job.job_id not in listed and job.grant_seq <= seen_grant:
                self._give_back(job, "not_held")

    def deregister(self, worker_id: str, now: float, reason: str = "left") -> None:
        worker = self.worker(worker_id, now)
        self._end_wait(worker, now)
        for job in self.ledger.held_by(worker_id):
            self._give_back(job, reason)
        self.pool.release_quarantined(worker_id)
        if worker.ipc_block is not None:
            for slot in self.pool.remove_owner(worker_id):
                job = self.ledger.jobs.get(slot.job_id)
                if job is not None and job.state is JobState.READY:
                    self.ledger.drop_ready(job)
                    self.counters.given_back["slot_lost"] += 1
        del self.workers[worker_id]
        self.journal.record("leave", w=worker_id, reason=reason)
        if worker.model is not None:
            self._rank_left(worker_id, now)

    def sweep(self, now: float, is_alive: Callable[[Worker], bool]) -> list[str]:
        """Declare silent or vanished workers dead and give back expired leases; returns the dead."""
        dead = [w.id for w in self.workers.values()
                if now - w.last_seen > self.options.worker_timeout_s or not is_alive(w)]
        for worker_id in dead:
            self.deregister(worker_id, now, reason="dead")
        for job in self.ledger.expired(now):
            self._give_back(job, "lease_expired")
        self._find_unreported_checkpoints()
        return dead

    def _find_unreported_checkpoints(self) -> None:
        """Once every job is committed, a model whose known checkpoint lags its step and that no live
        drafter trains may still have its last checkpoint on disk: written by a drafter whose report
        found no dispatcher, and which is not coming back to say so when it registers."""
        if not self.store.all_committed:
            return
        live = {w.model for w in self.workers.values() if w.model is not None}
        for model, step in self.ledger.model_step.items():
            if self.checkpoints.get(model, 0) < step and model not in live:
                on_disk = self.checkpoints.on_disk(model)
                if on_disk:
                    self.checkpoints.adopt(model, on_disk, ledger_step=step, worker_id=None, via="disk")

    def _give_back(self, job: Job, reason: str) -> None:
        slot_id, holder = job.slot, job.holder
        previous = self.ledger.give_back(job)
        if previous is JobState.EXTRACTING:
            if reason == "lease_expired":  # the writer may still be writing into it
                self.pool.quarantine(slot_id)
            else:  # the writer is gone, or says it does not hold the job
                self.pool.abort_write(slot_id)
        elif previous is JobState.TRAINING:
            if slot_id in self.pool.slots:
                self.pool.unread(slot_id, epoch=job.epoch, bucket=job.bucket)
            else:  # the slot's memory went with its owner: extract the job again
                self.ledger.drop_ready(job)
        self.counters.given_back[reason.split(":")[0]] += 1
        self.journal.record("give_back", job=job.job_id, was=previous.value, reason=reason, w=holder)

    def _wait(self, worker: Worker, reason: str, now: float) -> None:
        if worker.waiting_since is None:
            worker.waiting_since = now
        worker.wait_reason = reason

    def _end_wait(self, worker: Worker, now: float) -> None:
        if worker.waiting_since is not None:
            worker.total_wait_s += now - worker.waiting_since
            worker.waiting_since = None
            worker.wait_reason = ""

    def end_wait(self, worker_id: str, now: float) -> None:
        if worker_id in self.workers:
            self._end_wait(self.workers[worker_id], now)

    # -- targets ----------------------------------------------------------------------------
    def get_job(self, worker_id: str, now: float) -> JobGrant | str | None:
        worker = self.worker(worker_id, now)
        if self.done:
            self._end_wait(worker, now)
            return DONE
        self.store.maybe_start_next()
        queue = worker.queue if self.options.num_target_queues else 0
        head = self.ledger.peek_pending(queue) if queue is not None else None
        if head is None:
            self._wait(worker, "starved", now)
            return None
        slot_id = self.pool.writable_slot(worker_id)
        if slot_id is None:
            self._wait(worker, "blocked", now)
            return None
        generation = self.pool.begin_write(slot_id, worker_id, head)
        job = self.ledger.start_extract(worker_id, slot_id, generation, now, self.options.lease_s, queue, head=head)
        self._end_wait(worker, now)
        return self._grant(job, slot_id)

    def job_ready(self, worker_id: str, job_id: int, generation: int, busy_s: float, now: float) -> None:
        worker = self.worker(worker_id, now)
        job = self.ledger.mark_ready(job_id, worker_id, generation)
        self.pool.publish(job.slot, epoch=job.epoch, bucket=job.bucket)
        num_tokens = self._num_tokens(job)
        worker.num_tokens += num_tokens
        worker.num_jobs += 1
        self.journal.record("ready", job=job_id, w=worker_id, tokens=num_tokens, busy_s=round(busy_s, 6))

    def job_lengths(self, job_id_or_job: Job | int) -> np.ndarray:
        """The lengths of a job's samples (its schedule says which)."""
        job_id = job_id_or_job if isinstance(job_id_or_job, int) else job_id_or_job.job_id
        epoch, index = split_job_id(job_id)
        return self.lengths[self.schedule(epoch).samples_of(index)]

    def _num_tokens(self, job_id_or_job: Job | int) -> int:
        if isinstance(job_id_or_job, Job) and job_id_or_job.grant is not None:
            return job_id_or_job.grant[3]  # as its grant counted them
        return int(self.job_lengths(job_id_or_job).sum())

    def job_failed(self, worker_id: str, job_id: int, reason: str, now: float) -> None:
        self.worker(worker_id, now)
        job = self.ledger.jobs.get(job_id)
        if job is None or job.state is not JobState.EXTRACTING or job.holder != worker_id:
            raise LedgerError(f"job {job_id} is not being extracted by {worker_id}")
        slot_id = job.slot
        self.ledger.give_back(job)
        self.pool.abort_write(slot_id)  # the writer says it stopped writing
        self.counters.given_back["target_failed"] += 1
        self.journal.record("give_back", job=job_id, was="extracting", reason=f"target_failed: {reason}"[:200],
                            w=worker_id)

    # -- drafters ---------------------------------------------------------------------------
    def _serving_epoch(self) -> tuple[int, bool] | None:
        """The epoch drafters take from now, and whether its tail drains (nothing left to extract).

        Epochs are consumed in order: a drafter moves on to epoch e+1 only once every job of e has
        been handed to a drafter, so the consumed stream of each epoch stays proportional. One
        exception keeps the run live: when jobs of e went back to pending (a drafter died) while
        ready jobs of e+1 fill every slot, e+1 is served so that slots free up for e.
        """
        for epoch in self.store.open_epochs():
            if self.pool.has_ready(epoch):
                return epoch, self.ledger.count(epoch, JobState.PENDING) == 0
            if self.ledger.count(epoch, JobState.EXTRACTING, JobState.READY):
                return None
            if self.ledger.count(epoch, JobState.PENDING) and self.pool.has_free_slot():
                return None
        return None

    def nothing_left_to_hand_out(self) -> bool:
        if max(self.epoch_jobs) + 1 < self.options.epochs:
            return False
        return all(self.ledger.count(e, JobState.PENDING, JobState.EXTRACTING, JobState.READY) == 0
                   for e in self.epoch_jobs)

    def get_hs(self, worker_id: str, now: float, *, membership: int | None = None) -> tuple[JobGrant | str | None, bool]:
        """(grant, flush): flush tells a waiting drafter to commit its partial step, nothing more is
        coming. STEP_FULL: a rank of a cost-balanced group holds its share of the step in flight."""
        worker = self.worker(worker_id, now)
        group = None
        if self.groups.group_of_rank(worker_id) is not None:  # a rank of a data-parallel group
            self._step_boundary(worker_id, now)
            self.groups.check_current(worker_id, membership)
            group = self.groups.group_of(worker_id)
        if self.done:
            self._end_wait(worker, now)
            return DONE, False
        if group is not None and group.spec.balance == "cost":
            if worker_id in group.full:
                return None, False  # its next poll, sent as it went to the all-reduce: served once the step commits
            if self.has_its_share(group, worker_id):
                self._end_wait(worker, now)
                return STEP_FULL, False
        serving = self._serving_epoch()
        servable = self.pool.servable_nodes(draining=serving[1]) if serving is not None else None
        if not servable:  # the min-ready reservoir keeps a mix to choose from unless the epoch's tail drains
            self._wait(worker, "starved", now)
            return None, self.nothing_left_to_hand_out()
        epoch = serving[0]
        progress = self.ledger.epochs[epoch]
        # A group's step spans every rank's micro-batches: its window is what all of them hold.
        stepper: Worker | DrafterGroup = group or worker
        window = self.ledger.held_buckets(group.members if group else (worker_id,))
        eligible = self.pool.eligible(epoch, totals=progress.bucket_totals, taken=progress.taken,
                                      num_jobs=progress.num_jobs, num_taken=progress.num_taken)
        if not window:  # it holds nothing: a new accumulation window opens
            stepper.window_avail, stepper.window_mixed = len(eligible), True
        waited_s = now - worker.waiting_since if worker.waiting_since is not None else 0.0
        ready = self.pool.pick(epoch, eligible=eligible, window=window, node=worker.node, servable=servable,
                               waited_s=waited_s)
        if ready is None:  # only other nodes' slots, and not waited long enough for one of them
            self._wait(worker, "local_wait", now)
            return None, False
        self.counters.reads[worker.node, "local" if ready.local_to(worker.node) else "remote"] += 1
        if ready.bucket in window and any(b not in window for b in eligible):
            stepper.window_mixed = False
        self.pool.begin_read(ready)
        job = self.ledger.start_training(ready.job_id, worker_id, now, self.options.lease_s)
        self._end_wait(worker, now)
        return self._grant(job, ready.slot), False

    def consumed(self, worker_id: str, job_id: int, now: float) -> None:
        self.worker(worker_id, now)
        job = self.ledger.jobs.get(job_id)
        slot_id = job.slot if job is not None else None
        self.ledger.mark_consumed(job_id, worker_id)
        slot = self.pool.slots.get(slot_id)
        remote = {"remote": 1} if slot is not None and slot.node not in (None, self.workers[worker_id].node) else {}
        self.pool.release(slot_id)
        self.journal.record("consumed", job=job_id, w=worker_id, bucket=job.bucket, **remote)

    def read_failed(self, worker_id: str, job_id: int, reason: str, now: float) -> None:
        """The drafter found the slot stale: its data cannot be trusted, so the job is extracted again."""
        self.worker(worker_id, now)
        job = self.ledger.jobs.get(job_id)
        if job is None or job.state is not JobState.TRAINING or job.holder != worker_id:
            raise LedgerError(f"job {job_id} is not being read by {worker_id}")
        slot_id = job.slot
        self.ledger.drop_ready(job)
        self.pool.discard_ready(slot_id)
        self.counters.given_back["read_failed"] += 1
        self.journal.record("give_back", job=job_id, was="training", reason=f"read_failed: {reason}"[:200], w=worker_id)

    def commit_step(self, worker_id: str, job_ids: list[int], busy_s: float, now: float, *, model: str | None = None,
                    step: int | None = None, verified: int = 0, metrics: dict[str, float] | None = None,
                    sync_wait_s: float = 0.0, step_s: float = 0.0, membership: int | None = None,
                    rank_jobs: list[int] | None = None, rank_busy_s: list[float] | None = None,
                    cost_jobs: list[int] | None = None) -> int:
        """The drafter's model takes optimizer step ``step`` on ``job_ids``. Idempotent: the same
        (model, step, jobs) again gets the same answer. Refused (all or nothing) otherwise when a
        job is not consumed by this drafter or the step does not follow the model's last."""
        worker = self.worker(worker_id, now)
        self.groups.check_current(worker_id, membership)
        model = model or worker.model or worker_id
        group = self.groups.group_of(worker_id)
        if group is not None and model != group.model:
            raise LedgerError(f"{worker_id} trains model {group.model}, not {model}")
        # A group commits the step, not the rank: any current member's consumed jobs belong to it.
        holders = set(group.members) if group is not None else {worker_id}
        stepper: Worker | DrafterGroup = group or worker
        if step is None:
            step = self.ledger.model_step.get(model, 0) + 1
        if not job_ids:
            raise LedgerError("a step must hold at least one job")
        if self.ledger.last_commit.get(model) == (step, tuple(job_ids)):
            return step  # a retry of a commit whose reply was lost
        try:
            jobs = self.ledger.commit(job_ids, worker_id, model, step, holders=holders)
        except LedgerError:
            # All or nothing: the drafter drops the step (its gradients), so what it still holds of it is redone.
            for job_id in job_ids:
                job = self.ledger.jobs.get(job_id)
                if job is not None and job.state is JobState.CONSUMED and job.holder in holders:
                    self._give_back(job, "step_refused")
            raise
        num_tokens = sum(self._num_tokens(j) for j in jobs)
        self.journal.record("commit", durable=True, model=model, step=step, jobs=list(job_ids), w=worker_id,
                            buckets=sorted({j.bucket for j in jobs}), avail=stepper.window_avail,
                            mixed=stepper.window_mixed, tokens=num_tokens, busy_s=round(busy_s, 6), verified=verified,
                            **({"metrics": {**metrics, "step": int(metrics["step"])}} if metrics and "step" in metrics
                               else {}),  # the figures of that step (the drafter's previous one)
                            **({"membership": group.version, "sync_wait_s": round(sync_wait_s, 6),
                                "step_s": round(step_s, 6),
                                **({"rank_jobs": list(rank_jobs), "rank_busy_s": [round(b, 6) for b in rank_busy_s]}
                                   if rank_busy_s and rank_jobs else {})}
                               if group else {}))
        stepper.window_avail, stepper.window_mixed = None, True
        if group is not None:
            group.full = set()
            self._observe_step_costs(model, list(job_ids if cost_jobs is None else cost_jobs), rank_jobs, rank_busy_s)
        if metrics:
            worker.metrics = {k: v for k, v in metrics.items() if k != "step"}
        worker.num_jobs += len(jobs)
        worker.num_tokens += num_tokens
        for epoch in sorted({j.epoch for j in jobs}):
            if self.ledger.epoch_complete(epoch):
                self.journal.record("epoch_committed", durable=True, epoch=epoch)
                self.store.finish_if_complete(epoch)
        if group is not None:
            self._maybe_open(group, now)  # the step boundary waiting ranks wait for
        return step

    def checkpoint(self, worker_id: str, step: int, now: float, *, model: str | None = None,
                   metrics: dict[str, float] | None = None) -> None:
        """The model's state at ``step`` (its witness included) is durable on disk; ``metrics``: that
        step's figures (the last step's reach the journal this way: no commit follows it)."""
        worker = self.worker(worker_id, now)
        model = model or worker.model or worker_id
        held = self.ledger.model_step.get(model, 0)
        if step > held:
            raise LedgerError(f"model {model}: checkpoint of step {step} is ahead of the ledger's {held}")
        self.checkpoints[model] = max(self.checkpoints.get(model, 0), step)
        self.journal.record("checkpoint", durable=True, model=model, step=step, w=worker_id,
                            **({"metrics": {**metrics, "step": step}} if metrics else {}))
