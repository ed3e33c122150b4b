"""The core's job and slot ops: a target takes a pending job into a free slot and reports it ready;
a drafter takes a ready slot, copies it out and frees it. Every hand-over moves the job in the ledger
and the slot in the pool together, and journals it.

No sockets and no clock: :class:`dispatcher.core.DispatcherCore` passes ``now`` and decides, before
calling here, what depends on the run or on a drafter's group (done, a rank's version).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from common.run.descriptors import NixlExport, SlotExport
from common.run.records.events import JobConsumed, JobGivenBack, JobReady
from common.run.records.job_ids import split_job_id
from common.wire.errors import ErrorCode
from common.wire.messages import ReadyReport
from dispatcher.core_types import CoreOptions, Counters, JobGrant, Worker
from dispatcher.epochs import EpochStore
from dispatcher.groups import DrafterGroup
from dispatcher.journal import Journal
from dispatcher.ledger import Job, JobLedger, JobState, LedgerError
from dispatcher.pool import HSPool
from dispatcher.registry import WorkerRegistry

log = logging.getLogger("hsd.dispatcher")

# where a job is once its job_ready was applied, until it commits (a report sent again finds it there)
_PAST_READY = (JobState.READY, JobState.TRAINING, JobState.CONSUMED)
# The longest between two looks at the leases (each walks every job in flight): a lease is minutes
# long, and the sweep runs four times a second. A short lease is looked at every quarter of it.
LEASE_CHECK_S = 1.0


class JobOps:
    def __init__(self, options: CoreOptions, *, lengths: np.ndarray, ledger: JobLedger, pool: HSPool,
                 store: EpochStore, registry: WorkerRegistry, journal: Journal, counters: Counters,
                 shared_slots: int):
        self.options = options
        self.lengths = lengths
        self.ledger = ledger
        self.pool = pool
        self.store = store
        self.registry = registry
        self.journal = journal
        self.counters = counters
        self._next_slot_id = shared_slots
        self._next_lease_check = float("-inf")
        pool.add_slots(range(shared_slots))

    # -- what a job is --------------------------------------------------------------------------
    def grant(self, job: Job, slot_id: int) -> JobGrant:
        facts = job.grant
        if facts is None:  # its samples, their lengths, the padded length and the tokens: read once per job
            schedule = self.store.schedule(job.epoch)
            samples = schedule.sample_array(split_job_id(job.job_id)[1])
            lengths = self.lengths[samples].tolist()
            facts = job.grant = (samples.tolist(), lengths, schedule.padded_len(job.bucket, lengths), sum(lengths))
        samples, lengths, seq_len, _ = facts
        owner = self.pool.slots[slot_id].owner
        workers = self.registry.workers
        base = workers[owner].slot_base if owner else 0
        holder = workers[job.holder]
        holder.num_grants += 1
        job.grant_seq = holder.num_grants
        return JobGrant(job, slot_id - base, owner, seq_len, samples, lengths, job.grant_seq)

    def job_lengths(self, job_id_or_job: Job | int) -> np.ndarray:
        """The lengths of a job's samples (its schedule says which)."""
        job_id = job_id_or_job if isinstance(job_id_or_job, int) else job_id_or_job.job_id
        epoch, index = split_job_id(job_id)
        return self.lengths[self.store.schedule(epoch).samples_of(index)]

    def num_tokens(self, job_id_or_job: Job | int) -> int:
        if isinstance(job_id_or_job, Job) and job_id_or_job.grant is not None:
            return job_id_or_job.grant[3]  # as its grant counted them
        return int(self.job_lengths(job_id_or_job).sum())

    def give_back(self, job: Job, reason: str) -> None:
        """The job goes back to pending (or stays ready for another drafter), its slot with it."""
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
        self.journal.record(JobGivenBack(job=job.job_id, was=previous.value, reason=reason, w=holder))

    def give_back_unlisted(self, worker_id: str, holding: list[int], seen_grant: int) -> None:
        """A job the ledger says the worker holds, granted no later than ``seen_grant``, but not in
        ``holding``, was dropped or never reached it: it goes back at once."""
        listed = set(holding)
        for job in self.ledger.held_by(worker_id):
            if job.job_id not in listed and job.grant_seq <= seen_grant:
                self.give_back(job, "not_held")

    def expire_leases(self, now: float) -> None:
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + min(LEASE_CHECK_S, self.options.lease_s / 4)
        for job in self.ledger.expired(now):
            self.give_back(job, "lease_expired")

    # -- a session's slots ------------------------------------------------------------------------
    def register_slots(self, worker: Worker, ipc_block: SlotExport, num_slots: int) -> None:
        """A cuda_ipc or nixl target's own slots join the pool; drafters get ``ipc_block`` to open them.
        nixl slots live on the target's node (cuda_ipc ones on the dispatcher's, as every worker)."""
        if worker.role != "target" or worker.ipc_block is not None:
            raise LedgerError(f"{worker.id} cannot register slots (not a target, or registered them already)")
        if num_slots <= 0:
            raise LedgerError("num_slots must be positive")
        worker.ipc_block, worker.slot_base = ipc_block, self._next_slot_id
        self._next_slot_id += num_slots
        self.pool.add_slots(range(worker.slot_base, worker.slot_base + num_slots), owner=worker.id,
                            node=worker.node if isinstance(ipc_block, NixlExport) else None)
        if self.pool.effective_min_ready < self.pool.min_ready:
            log.warning("pool.min_ready=%d cannot be reached with the %d slot(s) live targets registered (and "
                        "pool.target_credits=%d): drafters are served from %d ready slot(s)", self.pool.min_ready,
                        len(self.pool.slots), self.pool.target_credits, self.pool.effective_min_ready)

    def end_session(self, worker: Worker, reason: str) -> None:
        """What a leaving worker held goes back; a target's own slots leave the pool with it."""
        for job in self.ledger.held_by(worker.id):
            self.give_back(job, reason)
        self.pool.release_quarantined(worker.id)
        if worker.ipc_block is not None:
            for slot in self.pool.remove_owner(worker.id):
                job = self.ledger.jobs.get(slot.job_id)
                if job is not None and job.state is JobState.READY:
                    self.ledger.drop_ready(job)
                    self.counters.given_back["slot_lost"] += 1

    # -- targets ------------------------------------------------------------------------------------
    def take_pending(self, worker: Worker, now: float) -> JobGrant | None:
        """The next pending job into a free slot for target ``worker`` (None: it waits)."""
        self.store.maybe_start_next()
        queue = worker.queue if self.options.num_target_queues else 0
        head = self.ledger.peek_pending(queue) if queue is not None else None
        if head is None:
            self.registry.wait(worker, "starved", now)
            return None
        slot_id = self.pool.writable_slot(worker.id)
        if slot_id is None:
            self.registry.wait(worker, "blocked", now)
            return None
        generation = self.pool.begin_write(slot_id, worker.id, head)
        job = self.ledger.start_extract(worker.id, slot_id, generation, now, self.options.lease_s, queue, head=head)
        self.registry.end_wait(worker, now)
        return self.grant(job, slot_id)

    def why_no_target_is_served(self) -> str | None:
        """What every target's get_job finds now, asked once for all of them: ``starved`` (no job
        pending, nor an epoch to start), ``blocked`` (no free slot anywhere: each target's own and the
        arena's are all taken), or None when some target may be served (a free slot, a pending job)."""
        self.store.maybe_start_next()  # as take_pending does first
        if not self.ledger.num_pending:
            return "starved"
        if not self.pool.has_free_slot():
            return "blocked"
        return None

    def job_ready(self, worker: Worker, job_id: int, generation: int, busy_s: float) -> None:
        job = self.ledger.mark_ready(job_id, worker.id, generation)
        self.pool.publish(job.slot, epoch=job.epoch, bucket=job.bucket)
        num_tokens = self.num_tokens(job)
        worker.num_tokens += num_tokens
        worker.num_jobs += 1
        self.journal.record(JobReady(job=job_id, w=worker.id, tokens=num_tokens, busy_s=round(busy_s, 6)))

    def ready_with_poll(self, worker: Worker, reports: list[ReadyReport]) -> int:
        """The job_ready reports a target's get_job carries (:meth:`_apply_carried`); how many slots
        they published. Applied already: the job left extraction at that generation, or committed."""
        def apply_once(report: ReadyReport) -> bool:
            job = self.ledger.jobs.get(report.job_id)
            if job is None and self.ledger.state_of(report.job_id) is JobState.COMMITTED:
                return False
            if job is not None and job.state in _PAST_READY and job.generation == report.generation:
                return False
            self.job_ready(worker, report.job_id, report.generation, report.busy_s)
            return True
        return self._apply_carried(worker, "job_ready", [(r.job_id, r) for r in reports], apply_once)

    def _apply_carried(self, worker: Worker, op: str, reports: list[tuple[int, Any]],
                       apply_once: Callable[[Any], bool]) -> int:
        """Reports of ``op`` that a poll carries, as (job id, report), applied before the poll is
        served; how many took effect. One applied already (the poll was sent again, its reply lost:
        ``apply_once`` says False) is skipped; one refused (the job was given back meanwhile) is
        logged and counted as the error a request of its own would have got, and the poll is served
        all the same."""
        applied = 0
        for job_id, report in reports:
            try:
                applied += apply_once(report)
            except LedgerError as exc:
                self.counters.errors[ErrorCode.BAD_STATE] += 1
                log.warning("%s: the %s report of job %d carried by a poll was refused: %s", worker.id, op, job_id,
                            exc)
        return applied

    def job_failed(self, worker_id: str, job_id: int, reason: str) -> None:
        job = self._held_as(job_id, worker_id, JobState.EXTRACTING)
        slot_id = job.slot
        self.ledger.give_back(job)
        self.pool.abort_write(slot_id)  # the writer says it stopped writing
        self._reported_back(job_id, worker_id, "target_failed", reason, was=JobState.EXTRACTING)

    def _held_as(self, job_id: int, worker_id: str, state: JobState) -> Job:
        """The job a worker reports on, which it must hold in ``state`` (else the report is stale)."""
        job = self.ledger.jobs.get(job_id)
        if job is None or job.state is not state or job.holder != worker_id:
            doing = "extracted" if state is JobState.EXTRACTING else "read"
            raise LedgerError(f"job {job_id} is not being {doing} by {worker_id}")
        return job

    def _reported_back(self, job_id: int, worker_id: str, cause: str, reason: str, *, was: JobState) -> None:
        self.counters.given_back[cause] += 1
        self.journal.record(JobGivenBack(job=job_id, was=was.value, reason=f"{cause}: {reason}"[:200], w=worker_id))

    # -- drafters -----------------------------------------------------------------------------------
    def serving_epoch(self) -> tuple[int, bool] | None:
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

    def ready_servable(self) -> bool:
        """Whether a drafter may be handed a ready slot now (the first test of :meth:`take_ready`,
        the same for every drafter: the epoch served, the min-ready reservoir)."""
        serving = self.serving_epoch()
        return serving is not None and self.pool.may_serve(draining=serving[1])

    def nothing_left_to_hand_out(self) -> bool:
        epoch_jobs = self.store.epoch_jobs
        if max(epoch_jobs) + 1 < self.options.epochs:
            return False
        return all(self.ledger.count(e, JobState.PENDING, JobState.EXTRACTING, JobState.READY) == 0
                   for e in epoch_jobs)

    def take_ready(self, worker: Worker, group: DrafterGroup | None, now: float) -> tuple[JobGrant | None, bool]:
        """(grant, flush) of a ready slot for drafter ``worker`` (of ``group``, a rank's), picked to keep
        its step's buckets mixed; flush: nothing more is coming, commit the partial step."""
        serving = self.serving_epoch()
        servable = self.pool.servable_nodes(draining=serving[1]) if serving is not None else None
        if not servable:  # the min-ready reservoir keeps a mix to choose from unless the epoch's tail drains
            self.registry.wait(worker, "starved", now)
            return None, self.nothing_left_to_hand_out()
        epoch = serving[0]
        progress = self.ledger.epochs[epoch]
        # A group's step spans every rank's micro-batches: its window is what all of them hold.
        stepper: Worker | DrafterGroup = group or worker
        window = self.ledger.held_buckets(group.members if group else (worker.id,))
        eligible = self.pool.eligible(epoch, totals=progress.bucket_totals, taken=progress.taken,
                                      num_jobs=progress.num_jobs, num_taken=progress.num_taken)
        if not window:  # it holds nothing: a new accumulation window opens
            stepper.window_avail, stepper.window_mixed = len(eligible), True
        waited_s = now - worker.waiting_since if worker.waiting_since is not None else 0.0
        ready = self.pool.pick(epoch, eligible=eligible, window=window, node=worker.node, servable=servable,
                               waited_s=waited_s)
        if ready is None:  # only other nodes' slots, and not waited long enough for one of them
            self.registry.wait(worker, "local_wait", now)
            return None, False
        self.counters.reads[worker.node, "local" if ready.local_to(worker.node) else "remote"] += 1
        if ready.bucket in window and not window.issuperset(eligible):
            stepper.window_mixed = False
        self.pool.begin_read(ready)
        job = self.ledger.start_training(ready.job_id, worker.id, now, self.options.lease_s)
        self.registry.end_wait(worker, now)
        return self.grant(job, ready.slot), False

    def consumed(self, worker: Worker, job_id: int) -> None:
        job = self.ledger.jobs.get(job_id)
        slot_id = job.slot if job is not None else None
        self.ledger.mark_consumed(job_id, worker.id)
        slot = self.pool.slots.get(slot_id)
        remote = 1 if slot is not None and slot.node not in (None, worker.node) else 0
        self.pool.release(slot_id)
        self.journal.record(JobConsumed(job=job_id, w=worker.id, bucket=job.bucket, remote=remote))

    def consumed_with_poll(self, worker: Worker, job_ids: list[int]) -> int:
        """The consumed reports a drafter's get_hs carries (:meth:`_apply_carried`); how many slots
        they freed. Applied already: the job is consumed by this drafter, or committed."""
        def apply_once(job_id: int) -> bool:
            job = self.ledger.jobs.get(job_id)
            state = job.state if job is not None else self.ledger.state_of(job_id)
            if state is JobState.COMMITTED or (state is JobState.CONSUMED and job.holder == worker.id):
                return False
            self.consumed(worker, job_id)
            return True
        return self._apply_carried(worker, "consumed", [(j, j) for j in job_ids], apply_once)

    def read_failed(self, worker_id: str, job_id: int, reason: str) -> None:
        """The drafter found the slot stale: its data cannot be trusted, so the job is extracted again."""
        job = self._held_as(job_id, worker_id, JobState.TRAINING)
        slot_id = job.slot
        self.ledger.drop_ready(job)
        self.pool.discard_ready(slot_id)
        self._reported_back(job_id, worker_id, "read_failed", reason, was=JobState.TRAINING)
