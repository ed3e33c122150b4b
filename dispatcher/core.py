"""The dispatcher's decisions, one method per protocol op, with no sockets and no clock of its own.

The socket loop (``dispatcher/server.py``) decodes a request, calls the method of the same name
here with ``now``, and encodes what comes back. Long-polls are the loop's business: ``get_job``
and ``get_hs`` answer None when nothing can be handed out yet and the loop asks again after every
state change. Everything a restart must know goes through the journal before the method returns.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from common.config import Config
from dispatcher.fairness import prefix_deviation
from dispatcher.journal import Journal, recover
from dispatcher.ledger import Job, JobLedger, JobState, LedgerError, split_job_id
from dispatcher.pool import HSPool
from dispatcher.schedule import EpochSchedule, build_epoch_schedule, load_schedule, save_schedule


class UnknownWorker(KeyError):
    pass


DONE = "done"  # get_job / get_hs result once every epoch is committed


@dataclass
class Worker:
    id: str
    role: str
    name: str
    pid: int
    host: str
    gpu: int | None
    registered_at: float
    last_seen: float
    waiting_since: float | None = None
    wait_reason: str = ""
    total_wait_s: float = 0.0
    num_tokens: int = 0
    num_jobs: int = 0
    window_avail: int | None = None  # drafter: buckets eligible when its accumulation window opened
    window_mixed: bool = True  # drafter: every pull of the window took a new bucket when one was eligible
    ipc_block: dict[str, Any] | None = None  # target on cuda_ipc: how drafters open its slots
    slot_base: int = 0


@dataclass
class JobGrant:
    job: Job
    slot: int  # index inside the slot owner's memory
    owner: str | None
    lengths: list[int]

    def to_wire(self, *, ipc_block: dict | None = None) -> dict[str, Any]:
        job = self.job
        wire = {"job_id": job.job_id, "epoch": job.epoch, "bucket": job.bucket, "seq_len": job.seq_len,
                "samples": list(job.samples), "lengths": self.lengths, "num_tokens": job.num_tokens, "slot": self.slot,
                "generation": job.generation, "owner": self.owner}
        if ipc_block is not None:
            wire["ipc"] = ipc_block
        return wire


@dataclass
class CoreOptions:
    lease_s: float
    worker_timeout_s: float
    epochs: int
    run_seed: int
    buckets: list[int]
    tokens_per_batch: int
    order: str

    @classmethod
    def from_config(cls, config: Config) -> "CoreOptions":
        return cls(lease_s=config.dispatcher.lease_s, worker_timeout_s=config.dispatcher.worker_timeout_s,
                   epochs=config.run.epochs, run_seed=config.run.seed, buckets=list(config.schedule.buckets),
                   tokens_per_batch=config.schedule.tokens_per_batch, order=config.schedule.order)


@dataclass
class Counters:
    requests: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    given_back: Counter = field(default_factory=Counter)


class DispatcherCore:
    def __init__(self, options: CoreOptions, *, run_dir, lengths: list[int], journal: Journal, pool: HSPool,
                 shared_slots: int, now: float):
        self.options = options
        self.run_dir = run_dir
        self.lengths = lengths
        self.journal = journal
        self.pool = pool
        self.ledger = JobLedger()
        self.workers: dict[str, Worker] = {}
        self.counters = Counters()
        self.started_at = now
        self.schedules: dict[int, EpochSchedule] = {}
        self.schedule_deviation: dict[int, float] = {}  # computed once: a schedule never changes
        self._next_worker = Counter()
        self._next_slot_id = shared_slots
        pool.add_slots(range(shared_slots))
        self._recover()

    # -- epochs -----------------------------------------------------------------------------
    def _recover(self) -> None:
        recovered = recover(self.run_dir)
        if recovered.steps_to_revert:
            self.journal.record("revert", durable=True, steps=recovered.steps_to_revert)
        self.next_step = recovered.next_step
        self.incarnation = recovered.num_starts
        for epoch in sorted(recovered.epochs_started):
            schedule = load_schedule(self.run_dir, epoch)
            if schedule is None:
                raise RuntimeError(f"journal names epoch {epoch} but its schedule file is missing in {self.run_dir}")
            self._add_schedule(schedule, recovered.committed)
        self.journal.record("start", resumed=bool(recovered.epochs_started),
                            committed=len(recovered.committed), reverted_steps=len(recovered.steps_to_revert))
        if not self.schedules:
            self._start_epoch(0)

    def _add_schedule(self, schedule: EpochSchedule, committed=()) -> None:
        max_lens = [b.max_len for b in schedule.buckets]
        batches = [(b.bucket, max_lens[b.bucket], b.samples, sum(self.lengths[s] for s in b.samples))
                   for b in schedule.batches]
        mine = [j for j in committed if split_job_id(j)[0] == schedule.epoch]
        self.ledger.add_epoch(schedule.epoch, batches, committed=mine)
        self.schedules[schedule.epoch] = schedule
        self.schedule_deviation[schedule.epoch] = prefix_deviation(schedule.bucket_order)

    def _start_epoch(self, epoch: int) -> None:
        schedule = load_schedule(self.run_dir, epoch)
        if schedule is None:
            o = self.options
            schedule = build_epoch_schedule(self.lengths, bucket_max_lens=o.buckets, tokens_per_batch=o.tokens_per_batch,
                                            run_seed=o.run_seed, epoch=epoch, order=o.order)
            if not schedule.batches:
                raise ValueError("the schedule holds no job: every sample is longer than the last bucket")
            save_schedule(schedule, self.run_dir)
        self._add_schedule(schedule)
        self.journal.record("epoch", durable=True, epoch=epoch, jobs=len(schedule.batches),
                            buckets=[b.num_batches for b in schedule.buckets])

    def _maybe_start_next_epoch(self) -> None:
        last = max(self.schedules)
        if self.ledger.num_pending == 0 and last + 1 < self.options.epochs:
            self._start_epoch(last + 1)

    @property
    def done(self) -> bool:
        return len(self.schedules) == self.options.epochs and all(
            self.ledger.epoch_complete(e) for e in self.schedules)

    def _open_epochs(self) -> list[int]:
        return [e for e in sorted(self.schedules) if not self.ledger.epoch_complete(e)]

    # -- membership -------------------------------------------------------------------------
    def register(self, *, role: str, name: str, pid: int, host: str, gpu: int | None, now: float) -> Worker:
        # The incarnation keeps ids unique across dispatcher restarts: a worker still speaking for
        # the previous dispatcher's "d0" must get unknown_worker, not the new d0's jobs.
        worker_id = f"{role[0]}{self._next_worker[role]}.{self.incarnation}"
        self._next_worker[role] += 1
        worker = Worker(worker_id, role, name, pid, host, gpu, registered_at=now, last_seen=now)
        self.workers[worker_id] = worker
        self.journal.record("join", w=worker_id, role=role, name=name, pid=pid, host=host)
        return worker

    def register_slots(self, worker_id: str, ipc_block: dict[str, Any], num_slots: int, now: float) -> None:
        """A cuda_ipc target's own slots join the pool; drafters get ``ipc_block`` to open them."""
        worker = self.worker(worker_id, now)
        if worker.role != "target" or worker.ipc_block is not None:
            raise LedgerError(f"{worker_id} cannot register slots (not a target, or registered them already)")
        if num_slots <= 0:
            raise LedgerError("num_slots must be positive")
        worker.ipc_block, worker.slot_base = ipc_block, self._next_slot_id
        self._next_slot_id += num_slots
        self.pool.add_slots(range(worker.slot_base, worker.slot_base + num_slots), owner=worker_id)

    def worker(self, worker_id: str, now: float) -> Worker:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(worker_id)
        worker.last_seen = now
        return worker

    def heartbeat(self, worker_id: str, now: float) -> None:
        """Keeps the worker alive; its leases are not renewed: a lease bounds one job's time."""
        self.worker(worker_id, now)

    def deregister(self, worker_id: str, now: float, reason: str = "left") -> None:
        worker = self.worker(worker_id, now)
        self._end_wait(worker, now)
        for job in self.ledger.held_by(worker_id):
            self._give_back(job, reason)
        if worker.ipc_block is not None:
            for slot in self.pool.remove_owner(worker_id):
                job = self.ledger.jobs[slot.job_id]
                if job.state is JobState.READY:
                    self.ledger.drop_ready(job)
                    self.counters.given_back["slot_lost"] += 1
        del self.workers[worker_id]
        self.journal.record("leave", w=worker_id, reason=reason)

    def sweep(self, now: float, is_alive: Callable[[Worker], bool]) -> list[str]:
        """Declare silent or vanished workers dead and give back expired leases; returns the dead."""
        dead = [w.id for w in self.workers.values()
                if now - w.last_seen > self.options.worker_timeout_s or not is_alive(w)]
        for worker_id in dead:
            self.deregister(worker_id, now, reason="dead")
        for job in self.ledger.expired(now):
            self._give_back(job, "lease_expired")
        return dead

    def _give_back(self, job: Job, reason: str) -> None:
        slot_id = job.slot
        previous = self.ledger.give_back(job)
        if previous is JobState.EXTRACTING:
            self.pool.abort_write(slot_id)
        elif previous is JobState.TRAINING:
            if slot_id in self.pool.slots:
                self.pool.unread(slot_id, epoch=job.epoch, bucket=job.bucket)
            else:  # the slot's memory went with its owner: extract the job again
                self.ledger.drop_ready(job)
        self.counters.given_back[reason] += 1
        self.journal.record("give_back", job=job.job_id, was=previous.value, reason=reason)

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
        self._maybe_start_next_epoch()
        if self.ledger.peek_pending() is None:
            self._wait(worker, "starved", now)
            return None
        slot_id = self.pool.writable_slot(worker_id)
        if slot_id is None:
            self._wait(worker, "blocked", now)
            return None
        head = self.ledger.peek_pending()
        generation = self.pool.begin_write(slot_id, worker_id, head.job_id)
        job = self.ledger.start_extract(worker_id, slot_id, generation, now, self.options.lease_s)
        self._end_wait(worker, now)
        owner = self.pool.slots[slot_id].owner
        base = self.workers[owner].slot_base if owner else 0
        return JobGrant(job, slot_id - base, owner, [self.lengths[s] for s in job.samples])

    def job_ready(self, worker_id: str, job_id: int, generation: int, busy_s: float, now: float) -> None:
        worker = self.worker(worker_id, now)
        job = self.ledger.mark_ready(job_id, worker_id, generation)
        self.pool.publish(job.slot, epoch=job.epoch, bucket=job.bucket)
        worker.num_tokens += job.num_tokens
        worker.num_jobs += 1
        self.journal.record("ready", job=job_id, w=worker_id, tokens=job.num_tokens, busy_s=round(busy_s, 6))

    def job_failed(self, worker_id: str, job_id: int, reason: str, now: float) -> None:
        self.worker(worker_id, now)
        job = self.ledger.jobs.get(job_id)
        if job is None or job.state is not JobState.EXTRACTING or job.holder != worker_id:
            raise LedgerError(f"job {job_id} is not being extracted by {worker_id}")
        self._give_back(job, f"target_failed: {reason}"[:200])

    # -- drafters ---------------------------------------------------------------------------
    def _serving_epoch(self) -> tuple[int, bool] | None:
        """The epoch drafters take from now, and whether its tail drains (nothing left to extract).

        Epochs are consumed in order: a drafter moves on to epoch e+1 only once every job of e has
        been handed to a drafter, so the consumed stream of each epoch stays proportional. One
        exception keeps the run live: when jobs of e went back to pending (a drafter died) while
        ready jobs of e+1 fill every slot, e+1 is served so that slots free up for e.
        """
        no_free_slot = not self.pool.has_free_slot()
        for epoch in self._open_epochs():
            if self.pool.has_ready(epoch):
                return epoch, self.ledger.count(epoch, JobState.PENDING) == 0
            if self.ledger.count(epoch, JobState.EXTRACTING, JobState.READY):
                return None
            if self.ledger.count(epoch, JobState.PENDING) and not no_free_slot:
                return None
        return None

    def nothing_left_to_hand_out(self) -> bool:
        if max(self.schedules) + 1 < self.options.epochs:
            return False
        return all(self.ledger.count(e, JobState.PENDING, JobState.EXTRACTING, JobState.READY) == 0
                   for e in self.schedules)

    def get_hs(self, worker_id: str, now: float) -> tuple[JobGrant | str | None, bool]:
        """(grant, flush): flush tells a waiting drafter to commit its partial step, nothing more is coming."""
        worker = self.worker(worker_id, now)
        if self.done:
            self._end_wait(worker, now)
            return DONE, False
        serving = self._serving_epoch()
        if serving is None or not self.pool.may_serve(draining=serving[1]):
            self._wait(worker, "starved", now)
            return None, self.nothing_left_to_hand_out()
        epoch = serving[0]
        progress = self.ledger.epochs[epoch]
        held = self.ledger.held_by(worker_id)
        eligible = self.pool.eligible(epoch, totals=progress.bucket_totals, taken=progress.taken)
        if not held:
            worker.window_avail, worker.window_mixed = len(eligible), True
        window = {job.bucket for job in held}
        ready = self.pool.pick(epoch, eligible=eligible, window=window)
        if ready.bucket in window and any(b not in window for b in eligible):
            worker.window_mixed = False
        self.pool.begin_read(ready)
        job = self.ledger.start_training(ready.job_id, worker_id, now, self.options.lease_s)
        self._end_wait(worker, now)
        owner = self.pool.slots[ready.slot].owner
        base = self.workers[owner].slot_base if owner else 0
        return JobGrant(job, ready.slot - base, owner, [self.lengths[s] for s in job.samples]), False

    def consumed(self, worker_id: str, job_id: int, now: float) -> None:
        self.worker(worker_id, now)
        job = self.ledger.jobs.get(job_id)
        slot_id = job.slot if job is not None else None
        self.ledger.mark_consumed(job_id, worker_id)
        self.pool.release(slot_id)
        self.journal.record("consumed", job=job_id, w=worker_id, bucket=job.bucket)

    def commit_step(self, worker_id: str, job_ids: list[int], busy_s: float, checkpointed: bool, now: float,
                    *, verified: int = 0) -> int:
        worker = self.worker(worker_id, now)
        if not job_ids:
            raise LedgerError("a step must hold at least one job")
        step = self.next_step
        try:
            jobs = self.ledger.commit(job_ids, worker_id, step)
        except LedgerError:
            # All or nothing: the drafter drops the step (its gradients), so what it still holds of it is redone.
            for job_id in job_ids:
                job = self.ledger.jobs.get(job_id)
                if job is not None and job.state is JobState.CONSUMED and job.holder == worker_id:
                    self._give_back(job, "step_refused")
            raise
        self.next_step += 1
        num_tokens = sum(j.num_tokens for j in jobs)
        self.journal.record("commit", durable=True, step=step, jobs=list(job_ids), w=worker_id,
                            buckets=sorted({j.bucket for j in jobs}), avail=worker.window_avail, mixed=worker.window_mixed,
                            tokens=num_tokens, busy_s=round(busy_s, 6),
                            checkpointed=checkpointed, verified=verified)
        worker.window_avail, worker.window_mixed = None, True
        worker.num_jobs += len(jobs)
        worker.num_tokens += num_tokens
        for epoch in sorted({j.epoch for j in jobs}):
            if self.ledger.epoch_complete(epoch):
                self.journal.record("epoch_committed", durable=True, epoch=epoch)
        return step

    def checkpoint(self, worker_id: str, step: int, now: float) -> None:
        self.worker(worker_id, now)
        self.journal.record("checkpoint", durable=True, step=step, w=worker_id)
