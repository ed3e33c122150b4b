"""The job ledger: one state per job, and the only place that changes it.

    pending -> extracting(target, slot, lease) -> ready(slot) -> training(drafter, lease)
            -> consumed(drafter) -> committed(step)

Give-backs (dead worker, expired lease, step that never completed):
    extracting -> pending   (back at the head of the queue, in original order)
    training   -> ready     (the slot still holds the data)
    consumed   -> pending   (the optimizer step it belonged to never completed)

Pure code: no sockets, no clock of its own (callers pass ``now``), no I/O.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from dispatcher.fairness import PrefixDeviation

JOB_ID_STRIDE = 1_000_000_000  # job id = epoch * stride + position in the epoch's job list


class JobState(str, enum.Enum):
    PENDING = "pending"
    EXTRACTING = "extracting"
    READY = "ready"
    TRAINING = "training"
    CONSUMED = "consumed"
    COMMITTED = "committed"


class LedgerError(Exception):
    """A transition the job's current state does not allow (a stale or duplicate request)."""


def make_job_id(epoch: int, index: int) -> int:
    return epoch * JOB_ID_STRIDE + index


def split_job_id(job_id: int) -> tuple[int, int]:
    return divmod(job_id, JOB_ID_STRIDE)


@dataclass
class Job:
    job_id: int
    epoch: int
    bucket: int
    seq_len: int
    samples: tuple[int, ...]
    num_tokens: int
    state: JobState = JobState.PENDING
    holder: str | None = None  # worker id while extracting / training / consumed
    slot: int | None = None
    generation: int = 0
    lease_deadline: float = 0.0
    step: int | None = None
    times_given_back: int = 0


@dataclass
class EpochProgress:
    num_jobs: int
    bucket_totals: dict[int, int]
    taken: Counter = field(default_factory=Counter)  # handed to drafters (training or later), per bucket
    consumed_order: list[int] = field(default_factory=list)  # bucket of each job as drafters took it
    committed: int = 0
    consumed_deviation: PrefixDeviation | None = None  # prefix deviation of consumed_order, kept current

    def __post_init__(self) -> None:
        self.recompute_deviation()

    def take(self, bucket: int) -> None:
        self.taken[bucket] += 1
        self.consumed_order.append(bucket)
        self.consumed_deviation.add(bucket)

    def recompute_deviation(self) -> None:
        self.consumed_deviation = PrefixDeviation(self.bucket_totals)
        for bucket in self.consumed_order:
            self.consumed_deviation.add(bucket)


class JobLedger:
    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.epochs: dict[int, EpochProgress] = {}
        self._pending: list[int] = []  # min-heap of job ids = schedule order across epochs
        self._by_holder: dict[str, set[int]] = defaultdict(set)
        self._counts: Counter = Counter()  # (epoch, state) -> number of jobs

    # -- epochs -----------------------------------------------------------------------------
    def add_epoch(self, epoch: int, batches: Sequence[tuple[int, int, tuple[int, ...], int]],
                  committed: Iterable[int] = ()) -> None:
        """batches: (bucket, seq_len, samples, num_tokens) in job order; ``committed`` job ids stay committed."""
        if epoch in self.epochs:
            raise LedgerError(f"epoch {epoch} already in the ledger")
        done = {j for j in committed if split_job_id(j)[0] == epoch and split_job_id(j)[1] < len(batches)}
        totals: Counter = Counter()
        for index, (bucket, seq_len, samples, num_tokens) in enumerate(batches):
            job_id = make_job_id(epoch, index)
            job = Job(job_id, epoch, bucket, seq_len, tuple(samples), num_tokens)
            if job_id in done:
                job.state = JobState.COMMITTED
            else:
                self._pending.append(job_id)
            self._counts[epoch, job.state] += 1
            self.jobs[job_id] = job
            totals[bucket] += 1
        progress = EpochProgress(num_jobs=len(batches), bucket_totals=dict(totals))
        for job_id in sorted(done):
            progress.take(self.jobs[job_id].bucket)
        progress.committed = len(done)
        self.epochs[epoch] = progress
        heapq.heapify(self._pending)

    def epoch_complete(self, epoch: int) -> bool:
        progress = self.epochs.get(epoch)
        return progress is not None and progress.committed == progress.num_jobs

    def count(self, epoch: int, *states: JobState) -> int:
        return sum(self._counts[epoch, state] for state in states)

    # -- queries ----------------------------------------------------------------------------
    def peek_pending(self) -> Job | None:
        return self.jobs[self._pending[0]] if self._pending else None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def held_by(self, worker_id: str) -> list[Job]:
        return [self.jobs[j] for j in sorted(self._by_holder.get(worker_id, ()))]

    def counts_by_state(self) -> dict[str, int]:
        return {state.value: sum(self.count(e, state) for e in self.epochs) for state in JobState}

    def _set_state(self, job: Job, state: JobState) -> None:
        self._counts[job.epoch, job.state] -= 1
        self._counts[job.epoch, state] += 1
        job.state = state

    def _expect(self, job_id: int, state: JobState, holder: str | None = None) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise LedgerError(f"unknown job {job_id}")
        if job.state is not state:
            raise LedgerError(f"job {job_id} is {job.state.value}, expected {state.value}")
        if holder is not None and job.holder != holder:
            raise LedgerError(f"job {job_id} is held by {job.holder}, not {holder}")
        return job

    def _hold(self, job: Job, holder: str | None) -> None:
        if job.holder is not None:
            self._by_holder[job.holder].discard(job.job_id)
        job.holder = holder
        if holder is not None:
            self._by_holder[holder].add(job.job_id)

    # -- transitions ------------------------------------------------------------------------
    def start_extract(self, target: str, slot: int, generation: int, now: float, lease_s: float) -> Job:
        """Hand the head of the pending queue to ``target``, writing into ``slot``."""
        if not self._pending:
            raise LedgerError("no pending job")
        job = self.jobs[heapq.heappop(self._pending)]
        self._set_state(job, JobState.EXTRACTING)
        job.slot, job.generation = slot, generation
        job.lease_deadline = now + lease_s
        self._hold(job, target)
        return job

    def mark_ready(self, job_id: int, target: str, generation: int) -> Job:
        job = self._expect(job_id, JobState.EXTRACTING, target)
        if job.generation != generation:
            raise LedgerError(f"job {job_id}: generation {generation} is stale (current {job.generation})")
        self._set_state(job, JobState.READY)
        self._hold(job, None)
        return job

    def start_training(self, job_id: int, drafter: str, now: float, lease_s: float) -> Job:
        job = self._expect(job_id, JobState.READY)
        self._set_state(job, JobState.TRAINING)
        job.lease_deadline = now + lease_s
        self._hold(job, drafter)
        self.epochs[job.epoch].take(job.bucket)
        return job

    def mark_consumed(self, job_id: int, drafter: str) -> Job:
        job = self._expect(job_id, JobState.TRAINING, drafter)
        self._set_state(job, JobState.CONSUMED)
        job.slot = None
        return job

    def commit(self, job_ids: Sequence[int], drafter: str, step: int) -> list[Job]:
        """All or nothing: every job must be consumed by ``drafter``."""
        jobs = [self._expect(job_id, JobState.CONSUMED, drafter) for job_id in job_ids]
        if len(set(job_ids)) != len(job_ids):
            raise LedgerError("a step lists the same job twice")
        for job in jobs:
            self._set_state(job, JobState.COMMITTED)
            job.step = step
            self._hold(job, None)
            self.epochs[job.epoch].committed += 1
        return jobs

    def give_back(self, job: Job) -> JobState:
        """Undo a job's progress after its holder failed; returns the state it was in."""
        previous = job.state
        job.times_given_back += 1
        if previous is JobState.EXTRACTING or previous is JobState.CONSUMED:
            if previous is JobState.CONSUMED:
                self._untake(job)
            self._push_pending(job)
        elif previous is JobState.TRAINING:
            self._untake(job)
            self._set_state(job, JobState.READY)
        else:
            raise LedgerError(f"job {job.job_id} in state {previous.value} has nothing to give back")
        self._hold(job, None)
        return previous

    def drop_ready(self, job: Job) -> None:
        """A ready job whose slot vanished (its memory's owner died): extract it again."""
        self._expect(job.job_id, JobState.READY)
        job.times_given_back += 1
        self._push_pending(job)

    def _push_pending(self, job: Job) -> None:
        self._set_state(job, JobState.PENDING)
        job.slot = None
        heapq.heappush(self._pending, job.job_id)

    def _untake(self, job: Job) -> None:
        progress = self.epochs[job.epoch]
        progress.taken[job.bucket] -= 1
        # The consumed stream records what drafters took; a give-back removes its last entry of this bucket.
        for i in range(len(progress.consumed_order) - 1, -1, -1):
            if progress.consumed_order[i] == job.bucket:
                del progress.consumed_order[i]
                break
        progress.recompute_deviation()  # rare (a give-back): a full pass is fine

    def release_worker(self, worker_id: str) -> list[tuple[Job, JobState]]:
        """Give back every job the worker holds (it died or left)."""
        return [(job, self.give_back(job)) for job in self.held_by(worker_id)]

    def expired(self, now: float) -> list[Job]:
        return [self.jobs[job_id] for held in self._by_holder.values() for job_id in held
                if self.jobs[job_id].state in (JobState.EXTRACTING, JobState.TRAINING)
                and self.jobs[job_id].lease_deadline < now]
