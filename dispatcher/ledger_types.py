"""The ledger's records: job states, a job in flight, an epoch's progress (``dispatcher/ledger.py``
decides every transition; these only hold what it decided). Pure data, no I/O."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from common.run.records.fairness import PrefixDeviation

NOT_COMMITTED = -1


class JobState(str, enum.Enum):
    PENDING = "pending"
    EXTRACTING = "extracting"
    READY = "ready"
    TRAINING = "training"
    CONSUMED = "consumed"
    COMMITTED = "committed"


_STATES = list(JobState)
_CODE = {state: code for code, state in enumerate(_STATES)}
_PENDING, _COMMITTED = _CODE[JobState.PENDING], _CODE[JobState.COMMITTED]


class LedgerError(Exception):
    """A transition the job's current state does not allow (a stale or duplicate request)."""


@dataclass
class Job:
    """A job in flight (extracting, ready, training or consumed)."""
    job_id: int
    epoch: int
    bucket: int
    state: JobState = JobState.PENDING
    holder: str | None = None  # worker id while extracting / training / consumed
    slot: int | None = None
    generation: int = 0
    lease_deadline: float = 0.0
    granted_at: float = 0.0  # when the current holder was handed the job
    grant_seq: int = 0       # the holder's grant counter when it was handed the job
    grant: tuple | None = None  # what its first grant computed from the schedule, reused by later ones (core)


@dataclass
class EpochProgress:
    num_jobs: int
    bucket_totals: dict[int, int]
    job_bucket: np.ndarray            # [num_jobs] the schedule's buckets
    state: np.ndarray                 # [num_jobs] uint8 state codes
    commit_step: np.ndarray           # [num_jobs] int64, NOT_COMMITTED unless committed
    commit_model: np.ndarray          # [num_jobs] int32 model index of the commit
    cursors: list[int] = field(default_factory=lambda: [0])  # per queue: its jobs from here on were never handed out
    taken: Counter = field(default_factory=Counter)  # handed to drafters (training or later), per bucket
    committed: int = 0
    consumed_deviation: PrefixDeviation | None = None  # prefix deviation of the consumed stream, kept current
    version: int = 0     # bumped by every change of the commit arrays: a snapshot knows what it copied
    sealed: bool = False  # finished and snapshotted: the arrays are read-only mappings of files
    latest_step: dict[int, int] = field(default_factory=dict)  # sealed: model index -> its latest step here
    counts: list[int] = field(default_factory=lambda: [0] * len(_STATES))  # state code -> jobs in that state
    num_taken: int = 0  # sum(taken.values()), kept as it changes

    def __post_init__(self) -> None:
        self.consumed_deviation = PrefixDeviation(self.bucket_totals)

    def take(self, bucket: int) -> None:
        self.taken[bucket] += 1
        self.num_taken += 1
        self.consumed_deviation.add(bucket)

    def take_many(self, bucket: int, count: int) -> None:
        self.taken[bucket] += count
        self.num_taken += count
        self.consumed_deviation.add_many(bucket, count)

    def untake(self, bucket: int) -> None:
        self.taken[bucket] -= 1
        self.num_taken -= 1
        self.consumed_deviation.remove(bucket)
