"""The job ledger: one state per job, and the only place that changes it.

    pending -> extracting(target, slot, lease) -> ready(slot) -> training(drafter, lease)
            -> consumed(drafter) -> committed(model, step)

Give-backs (dead worker, expired lease, step that never completed):
    extracting -> pending   (back at the head of the queue, in original order)
    training   -> ready     (the slot still holds the data)
    consumed   -> pending   (the optimizer step it belonged to never completed)
Rollback (a model registers with an older step than the ledger holds for it):
    committed(model, step > s) -> pending

Sized for a million jobs an epoch: a job's state, and the model and step that committed it, are
entries of per-epoch arrays; only the few jobs in flight (bounded by the pool and the drafters'
windows) have an object. Jobs never handed out are found by a cursor that walks each epoch's list;
jobs given back wait in a small heap, so the queue stays in schedule order. A finished epoch, once a
snapshot holds it, is *sealed*: its arrays become read-only mappings of the snapshot's files, so the
memory of the ledger stays that of the open epochs however many have finished. A rollback that
reaches into a sealed epoch unseals it (copies it back into memory) first.

Queues: one shared queue (``num_queues=1``), or T fixed queues, queue k holding the jobs whose index
is k mod T (the per-target assignment this project replaces, kept for comparison); each has its own
cursors (stepping by T) and heap of given-back jobs, so finding its next job stays O(1) amortized.

Pure code: no sockets, no clock of its own (callers pass ``now``), no I/O.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np

from common.run.records.job_ids import JOB_ID_STRIDE, make_job_id, split_job_id
from dispatcher.ledger_types import (_CODE, _COMMITTED, _PENDING, _STATES, NOT_COMMITTED,  # noqa: F401
                                     EpochProgress, Job, JobState, LedgerError)


class JobLedger:
    def __init__(self, num_queues: int = 1) -> None:
        if num_queues < 1:
            raise ValueError(f"num_queues must be at least 1, got {num_queues}")
        self.num_queues = num_queues
        self.jobs: dict[int, Job] = {}  # jobs in flight only
        self.epochs: dict[int, EpochProgress] = {}
        self._epoch_order: list[int] = []  # the keys of ``epochs``, sorted
        self._returned: list[list[int]] = [[] for _ in range(num_queues)]  # per queue: min-heap of given-back job ids
        self._by_holder: dict[str, set[int]] = defaultdict(set)
        # Jobs per state code, over every epoch (each epoch keeps its own in EpochProgress.counts):
        # the questions every request asks (anything pending? every job committed?) stay O(1).
        self._totals: list[int] = [0] * len(_STATES)
        self._num_jobs = 0
        self.model_index: dict[str, int] = {}  # model id -> index stored in commit_model
        self.model_step: dict[str, int] = {}   # model id -> last step the ledger holds for it
        # model id -> (step, job ids) of its last commit: a retried commit gets the first answer
        self.last_commit: dict[str, tuple[int, tuple[int, ...]]] = {}

    # -- epochs -----------------------------------------------------------------------------
    def add_epoch(self, epoch: int, job_bucket: Sequence[int] | np.ndarray) -> EpochProgress:
        """Add an epoch's jobs (their buckets, in job order), every job pending."""
        if epoch in self.epochs:
            raise LedgerError(f"epoch {epoch} already in the ledger")
        job_bucket = np.asarray(job_bucket)
        num_jobs = len(job_bucket)
        counts = np.bincount(job_bucket, minlength=1) if num_jobs else np.zeros(0, dtype=np.int64)
        progress = EpochProgress(num_jobs=num_jobs, bucket_totals={b: int(n) for b, n in enumerate(counts) if n},
                                 job_bucket=job_bucket, state=np.zeros(num_jobs, dtype=np.uint8),
                                 commit_step=np.full(num_jobs, NOT_COMMITTED, dtype=np.int64),
                                 commit_model=np.full(num_jobs, -1, dtype=np.int32),
                                 cursors=list(range(self.num_queues)))
        self.epochs[epoch] = progress
        self._epoch_order = sorted(self.epochs)
        progress.counts[_PENDING] = num_jobs
        self._totals[_PENDING] += num_jobs
        self._num_jobs += num_jobs
        return progress

    def restore_arrays(self, epoch: int, commit_step: np.ndarray, commit_model: np.ndarray) -> None:
        """Mark committed what a snapshot says was (restart)."""
        progress = self.epochs[epoch]
        committed = np.flatnonzero(commit_step != NOT_COMMITTED)
        progress.commit_step[:] = commit_step
        progress.commit_model[:] = commit_model
        progress.state[committed] = _COMMITTED
        for counts in (progress.counts, self._totals):
            counts[_PENDING] -= len(committed)
            counts[_COMMITTED] += len(committed)
        progress.committed += len(committed)
        for bucket, n in enumerate(np.bincount(progress.job_bucket[committed]).tolist() if len(committed) else []):
            progress.take_many(bucket, n)  # one call per bucket: a restart after a million commits stays fast

    def restore_commit(self, model: str, step: int, job_ids: Sequence[int]) -> None:
        """Replay one journaled commit (restart): its jobs go straight from pending to committed."""
        index_of_model = self._model(model)
        for job_id in job_ids:
            epoch, index = split_job_id(job_id)
            progress = self.epochs[epoch]
            if progress.state[index] != _PENDING:
                raise LedgerError(f"journal commits job {job_id} twice")
            self._set_code(epoch, progress, index, _COMMITTED)
            progress.commit_step[index] = step
            progress.commit_model[index] = index_of_model
            progress.committed += 1
            progress.version += 1
            progress.take(int(progress.job_bucket[index]))
        self.model_step[model] = step
        self.last_commit[model] = (step, tuple(job_ids))

    def restore_model(self, model: str, step: int, last_commit: tuple[int, tuple[int, ...]] | None) -> None:
        self._model(model)
        self.model_step[model] = step
        if last_commit is not None:
            self.last_commit[model] = last_commit

    def seal_epoch(self, epoch: int, commit_step: np.ndarray, commit_model: np.ndarray,
                   job_bucket: np.ndarray) -> None:
        """A finished epoch whose arrays a snapshot holds: keep read-only mappings of those files instead.

        ``commit_step``/``commit_model`` must equal the epoch's arrays (the caller mapped the snapshot
        that copied them at the current version). Each model's latest step in the epoch is kept, so a
        rollback that cannot reach the epoch never touches its pages.
        """
        progress = self.epochs[epoch]
        if progress.committed != progress.num_jobs:
            raise LedgerError(f"epoch {epoch} is not finished: it cannot be sealed")
        if progress.sealed:
            return
        latest: dict[int, int] = {}
        if progress.num_jobs:  # every job is committed: every commit_model entry names a model
            by_model = np.full(int(progress.commit_model.max()) + 1, NOT_COMMITTED, dtype=np.int64)
            np.maximum.at(by_model, progress.commit_model, progress.commit_step)  # 5 ms a million jobs
            latest = {m: int(step) for m, step in enumerate(by_model.tolist()) if step != NOT_COMMITTED}
        progress.latest_step = latest
        progress.commit_step, progress.commit_model = commit_step, commit_model
        progress.job_bucket = job_bucket
        progress.state = np.broadcast_to(np.uint8(_COMMITTED), (progress.num_jobs,))
        progress.sealed = True

    def _unseal(self, progress: EpochProgress) -> None:
        progress.commit_step = np.array(progress.commit_step)
        progress.commit_model = np.array(progress.commit_model)
        progress.state = np.full(progress.num_jobs, _COMMITTED, dtype=np.uint8)
        progress.sealed = False
        progress.latest_step = {}

    def open_epochs(self) -> list[int]:
        """The epochs not every job of which is committed, in order."""
        epochs = self.epochs
        return [e for e in self._epoch_order if epochs[e].committed != epochs[e].num_jobs]

    def epoch_complete(self, epoch: int) -> bool:
        progress = self.epochs.get(epoch)
        return progress is not None and progress.committed == progress.num_jobs

    def count(self, epoch: int, *states: JobState) -> int:
        progress = self.epochs.get(epoch)
        if progress is None:
            return 0
        counts = progress.counts
        if len(states) == 1:  # the common question, asked by every get_hs: no generator
            return counts[_CODE[states[0]]]
        return sum(counts[_CODE[state]] for state in states)

    @property
    def all_committed(self) -> bool:
        """Every job of every epoch in the ledger is committed."""
        return self._totals[_COMMITTED] == self._num_jobs

    def state_of(self, job_id: int) -> JobState:
        epoch, index = split_job_id(job_id)
        progress = self.epochs.get(epoch)
        if progress is None or not 0 <= index < progress.num_jobs:
            raise LedgerError(f"unknown job {job_id}")
        return _STATES[progress.state[index]]

    def bucket_of(self, job_id: int) -> int:
        epoch, index = split_job_id(job_id)
        return int(self.epochs[epoch].job_bucket[index])

    # -- queries ----------------------------------------------------------------------------
    def queue_of(self, job_id: int) -> int:
        return split_job_id(job_id)[1] % self.num_queues

    def peek_pending(self, queue: int = 0) -> int | None:
        """The job id at the head of pending ``queue`` (schedule order across epochs), or None."""
        returned = self._returned[queue]
        # An entry goes stale when its job left pending another way (a replayed commit after a
        # replayed rollback): drop those lazily.
        while returned and self.state_of(returned[0]) is not JobState.PENDING:
            heapq.heappop(returned)
        head = returned[0] if returned else None
        for epoch in self._epoch_order:
            progress = self.epochs[epoch]
            if not progress.counts[_PENDING]:
                continue  # nothing of it is pending: its cursor has nothing to find
            cursor, state = progress.cursors[queue], progress.state
            while cursor < progress.num_jobs and state.item(cursor) != _PENDING:
                cursor += self.num_queues
            progress.cursors[queue] = cursor
            if cursor < progress.num_jobs:
                fresh = make_job_id(epoch, cursor)
                return fresh if head is None or fresh < head else head
        return head

    @property
    def num_pending(self) -> int:
        return self._totals[_PENDING]

    def held_by(self, worker_id: str) -> list[Job]:
        return [self.jobs[j] for j in sorted(self._by_holder.get(worker_id, ()))]

    def held_buckets(self, worker_ids: Iterable[str]) -> set[int]:
        """The buckets of the jobs these workers hold (empty: they hold none)."""
        jobs, by_holder = self.jobs, self._by_holder
        return {jobs[j].bucket for worker_id in worker_ids for j in by_holder.get(worker_id, ())}

    def counts_by_state(self) -> dict[str, int]:
        return {state.value: sum(self.count(e, state) for e in self.epochs) for state in JobState}

    def _model(self, model: str) -> int:
        if model not in self.model_index:
            self.model_index[model] = len(self.model_index)
            self.model_step.setdefault(model, 0)
        return self.model_index[model]

    def _set_code(self, epoch: int, progress: EpochProgress, index: int, code: int) -> None:
        old = progress.state.item(index)
        counts, totals = progress.counts, self._totals
        counts[old] -= 1
        counts[code] += 1
        totals[old] -= 1
        totals[code] += 1
        progress.state[index] = code

    def _set_state(self, job: Job, state: JobState) -> None:
        self._set_code(job.epoch, self.epochs[job.epoch], job.job_id - job.epoch * JOB_ID_STRIDE, _CODE[state])
        job.state = state

    def _expect(self, job_id: int, state: JobState, holder: str | None = None) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise LedgerError(f"job {job_id} is {self._describe(job_id)}, expected {state.value}")
        if job.state is not state:
            raise LedgerError(f"job {job_id} is {job.state.value}, expected {state.value}")
        if holder is not None and job.holder != holder:
            raise LedgerError(f"job {job_id} is held by {job.holder}, not {holder}")
        return job

    def _describe(self, job_id: int) -> str:
        try:
            return self.state_of(job_id).value
        except LedgerError:
            return "unknown"

    def _hold(self, job: Job, holder: str | None, now: float = 0.0) -> None:
        if job.holder is not None:
            self._by_holder[job.holder].discard(job.job_id)
            if not self._by_holder[job.holder]:
                del self._by_holder[job.holder]
        job.holder = holder
        if holder is not None:
            self._by_holder[holder].add(job.job_id)
            job.granted_at = now

    # -- transitions ------------------------------------------------------------------------
    def start_extract(self, target: str, slot: int, generation: int, now: float, lease_s: float,
                      queue: int = 0, *, head: int | None = None) -> Job:
        """Hand the head of pending ``queue`` to ``target``, writing into ``slot``. ``head``: what
        :meth:`peek_pending` just answered for ``queue``, with no change of the ledger since."""
        job_id = self.peek_pending(queue) if head is None else head
        if job_id is None:
            raise LedgerError("no pending job")
        returned = self._returned[queue]
        if returned and returned[0] == job_id:
            heapq.heappop(returned)
        epoch, index = split_job_id(job_id)
        job = Job(job_id, epoch, int(self.epochs[epoch].job_bucket[index]))
        self.jobs[job_id] = job
        self._set_state(job, JobState.EXTRACTING)
        job.slot, job.generation = slot, generation
        job.lease_deadline = now + lease_s
        self._hold(job, target, now)
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
        self._hold(job, drafter, now)
        self.epochs[job.epoch].take(job.bucket)
        return job

    def mark_consumed(self, job_id: int, drafter: str) -> Job:
        job = self._expect(job_id, JobState.TRAINING, drafter)
        self._set_state(job, JobState.CONSUMED)
        job.slot = None
        return job

    def commit(self, job_ids: Sequence[int], drafter: str, model: str, step: int, *,
               holders: set[str] | None = None) -> list[Job]:
        """All or nothing: every job must be consumed by ``drafter`` (or, for a data-parallel group's
        step, by one of ``holders``); ``step`` follows the model's last."""
        if len(set(job_ids)) != len(job_ids):
            raise LedgerError("a step lists the same job twice")
        expected = self.model_step.get(model, 0) + 1
        if step != expected:
            raise LedgerError(f"model {model}: step {step} does not follow the ledger's step {expected - 1}")
        holders = holders or {drafter}
        jobs = [self._expect(job_id, JobState.CONSUMED) for job_id in job_ids]
        for job in jobs:
            if job.holder not in holders:
                raise LedgerError(f"job {job.job_id} is held by {job.holder}, not {' or '.join(sorted(holders))}")
        index_of_model = self._model(model)
        for job in jobs:
            self._set_state(job, JobState.COMMITTED)
            self._hold(job, None)
            progress = self.epochs[job.epoch]
            index = split_job_id(job.job_id)[1]
            progress.commit_step[index] = step
            progress.commit_model[index] = index_of_model
            progress.committed += 1
            progress.version += 1
            del self.jobs[job.job_id]
        self.model_step[model] = step
        self.last_commit[model] = (step, tuple(job_ids))
        return jobs

    def rollback(self, model: str, step: int) -> list[int]:
        """The model holds ``step``: its commits after it go back to pending. Returns their job ids.

        A scan of the per-epoch arrays: rare (a model restarted from a checkpoint), and it needs no
        per-step record of the past.
        """
        index_of_model = self._model(model)
        if step > self.model_step[model]:
            raise LedgerError(f"model {model} is at step {step}, ahead of the ledger's {self.model_step[model]}")
        if step == self.model_step[model]:  # no commit of a model is past its step: nothing to scan for
            return []  # (every drafter of a new model registers at step 0)
        reverted = []
        for epoch in sorted(self.epochs):
            progress = self.epochs[epoch]
            if progress.sealed:
                if progress.latest_step.get(index_of_model, NOT_COMMITTED) <= step:
                    continue
                self._unseal(progress)
            later = np.flatnonzero((progress.commit_model == index_of_model) & (progress.commit_step > step))
            for index in later.tolist():
                self._set_code(epoch, progress, index, _PENDING)
                progress.untake(int(progress.job_bucket[index]))
                reverted.append(make_job_id(epoch, index))
            progress.commit_step[later] = NOT_COMMITTED
            progress.commit_model[later] = -1
            progress.committed -= len(later)
            progress.version += bool(len(later))
        for job_id in reverted:
            heapq.heappush(self._returned[self.queue_of(job_id)], job_id)
        self.model_step[model] = step
        if self.last_commit.get(model, (0,))[0] > step:
            del self.last_commit[model]
        return reverted

    def give_back(self, job: Job) -> JobState:
        """Undo a job's progress after its holder failed; returns the state it was in."""
        previous = job.state
        if previous is JobState.EXTRACTING or previous is JobState.CONSUMED:
            if previous is JobState.CONSUMED:
                self.epochs[job.epoch].untake(job.bucket)
            self._hold(job, None)
            self._push_pending(job)
        elif previous is JobState.TRAINING:
            self.epochs[job.epoch].untake(job.bucket)
            self._set_state(job, JobState.READY)
            self._hold(job, None)
        else:
            raise LedgerError(f"job {job.job_id} in state {previous.value} has nothing to give back")
        return previous

    def drop_ready(self, job: Job) -> None:
        """A ready job whose slot vanished or cannot be trusted: extract it again."""
        if job.state is JobState.TRAINING:
            self.epochs[job.epoch].untake(job.bucket)
            self._hold(job, None)
        elif job.state is not JobState.READY:
            raise LedgerError(f"job {job.job_id} is {job.state.value}, expected ready")
        self._push_pending(job)

    def _push_pending(self, job: Job) -> None:
        self._set_state(job, JobState.PENDING)
        del self.jobs[job.job_id]
        heapq.heappush(self._returned[self.queue_of(job.job_id)], job.job_id)

    def release_worker(self, worker_id: str) -> list[tuple[Job, JobState]]:
        """Give back every job the worker holds (it died or left)."""
        return [(job, self.give_back(job)) for job in self.held_by(worker_id)]

    def expired(self, now: float) -> list[Job]:
        return [job for job in self.jobs.values()
                if job.state in (JobState.EXTRACTING, JobState.TRAINING) and job.lease_deadline < now]
