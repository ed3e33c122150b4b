"""Accounting of the hidden-state pool: which slot is free, being written, ready or being read.

The memory itself belongs to the transport (a shared-memory arena created by the dispatcher, or
one CUDA allocation per target); this module only decides. Pure code.

- A target gets a job only together with a free slot it can write (credit-based backpressure),
  and never holds more than ``target_credits`` slots at once: memory is bounded by construction.
- Drafters are served only while at least ``min_ready`` slots are ready, except while an epoch's
  tail drains (nothing of it is left to extract).
- Pull policy ``deficit``: the ready job whose bucket lags most in consumption against its share
  of the epoch, preferring buckets the drafter has not used in its current accumulation window,
  random within the bucket. ``random`` is the naive policy kept for comparison.
"""

from __future__ import annotations

import enum
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable

PULL_POLICIES = ("deficit", "random")


class SlotState(str, enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"
    READING = "reading"
    QUARANTINED = "quarantined"  # its writer lost the lease but may still be writing: not reused until it is gone


@dataclass
class Slot:
    id: int
    owner: str | None  # the target whose memory holds it (cuda_ipc); None for the shared arena
    state: SlotState = SlotState.FREE
    job_id: int | None = None
    generation: int = 0
    writer: str | None = None


@dataclass(frozen=True)
class ReadyJob:
    job_id: int
    epoch: int
    bucket: int
    slot: int


# A bucket may run ahead of its share of the consumed stream by less than this many batches when
# the drafter's accumulation window asks for a bucket it has not used yet. It is what lets every
# step mix lengths while each prefix of the consumed stream stays proportional.
MIX_SLACK = 1.0
# A bucket lagging its share by this many batches is served first, window or not: mixing never
# lets the dominant bucket fall behind by more.
MAX_LAG = 1.5


def eligible_buckets(candidates: Iterable[int], *, totals: dict[int, int], taken: Counter) -> dict[int, float]:
    """Ready buckets not already ahead of their share by MIX_SLACK, with their consumption deficit.

    A bucket lagging by MAX_LAG or more, or (when every ready bucket is ahead) the least-ahead one,
    is eligible alone.
    """
    num_jobs = sum(totals.values())
    position = sum(taken.values()) + 1
    deficits = {b: position * totals.get(b, 0) / num_jobs - taken.get(b, 0) for b in candidates}
    if not deficits:
        return {}
    best = max(deficits.values())
    eligible = {b: d for b, d in deficits.items() if d > -MIX_SLACK}
    if best >= MAX_LAG or not eligible:
        eligible = {b: d for b, d in deficits.items() if d >= best - 1e-9}
    return eligible


def choose_bucket(deficits: dict[int, float], *, window: set[int], rng: random.Random) -> int:
    """Largest deficit among the eligible buckets, those outside the drafter's window first."""
    fresh = {b: d for b, d in deficits.items() if b not in window}
    pool = fresh or deficits
    best = max(pool.values())
    return rng.choice(sorted(b for b, d in pool.items() if d >= best - 1e-9))


class HSPool:
    def __init__(self, *, min_ready: int, target_credits: int, pull: str = "deficit", seed: int = 0,
                 num_buckets: int = 0):
        if pull not in PULL_POLICIES:
            raise ValueError(f"unknown pull policy {pull!r} (known: {', '.join(PULL_POLICIES)})")
        self.min_ready = min_ready
        self.target_credits = target_credits
        self.pull = pull
        # every bucket of the schedule is listed in ready_per_bucket, empty ones as 0: a watcher's
        # series for a bucket must not vanish while that bucket has nothing ready
        self.num_buckets = num_buckets
        self.rng = random.Random(seed)
        self.slots: dict[int, Slot] = {}
        self._free: dict[str | None, list[int]] = defaultdict(list)  # owner -> free slot ids
        self._credits: Counter = Counter()  # target -> slots it is writing
        self._ready: dict[int, dict[int, dict[int, ReadyJob]]] = defaultdict(lambda: defaultdict(dict))
        self._num_ready = 0
        self.peak_in_use = 0  # most slots ever held by a job at once (writing, ready or reading)

    # -- slots ------------------------------------------------------------------------------
    def add_slots(self, slot_ids: Iterable[int], owner: str | None = None) -> None:
        for slot_id in slot_ids:
            if slot_id in self.slots:
                raise ValueError(f"slot {slot_id} already in the pool")
            self.slots[slot_id] = Slot(slot_id, owner)
            self._free[owner].append(slot_id)

    def remove_owner(self, owner: str) -> list[Slot]:
        """The owner's memory is gone: drop its slots; returns those that held a job."""
        lost = []
        for slot in [s for s in self.slots.values() if s.owner == owner]:
            if slot.state is SlotState.READY:
                self._unindex(slot)
            if slot.job_id is not None:
                lost.append(slot)
            del self.slots[slot.id]
        self._free.pop(owner, None)
        return lost

    @property
    def num_ready(self) -> int:
        return self._num_ready

    def counts(self) -> dict[str, int]:
        counts = Counter(slot.state.value for slot in self.slots.values())
        return {state.value: counts.get(state.value, 0) for state in SlotState}

    def ready_per_bucket(self) -> dict[int, int]:
        """Ready slots per bucket index: every bucket of the schedule, 0 for an empty one."""
        out: Counter = Counter(dict.fromkeys(range(self.num_buckets), 0))
        for per_bucket in self._ready.values():
            for bucket, jobs in per_bucket.items():
                if jobs:
                    out[bucket] += len(jobs)
        return dict(sorted(out.items()))

    # -- targets ----------------------------------------------------------------------------
    def writable_slot(self, target: str) -> int | None:
        """A free slot ``target`` may fill now, or None (no slot, or its credits are spent)."""
        if self._credits[target] >= self.target_credits:
            return None
        for owner in (target, None):
            if self._free.get(owner):
                return self._free[owner][-1]
        return None

    def blocked_reason(self, target: str) -> str:
        return "credits" if self._credits[target] >= self.target_credits else "no_free_slot"

    def begin_write(self, slot_id: int, target: str, job_id: int) -> int:
        """Reserve the slot for ``job_id``; returns the slot's new generation."""
        slot = self.slots[slot_id]
        assert slot.state is SlotState.FREE, slot
        self._free[slot.owner].remove(slot_id)
        slot.state, slot.job_id, slot.writer = SlotState.WRITING, job_id, target
        slot.generation += 1
        self._credits[target] += 1
        self.peak_in_use = max(self.peak_in_use, len(self.slots) - sum(len(free) for free in self._free.values()))
        return slot.generation

    def publish(self, slot_id: int, *, epoch: int, bucket: int) -> None:
        slot = self.slots[slot_id]
        assert slot.state is SlotState.WRITING, slot
        self._credits[slot.writer] -= 1
        slot.state, slot.writer = SlotState.READY, None
        self._ready[epoch][bucket][slot.job_id] = ReadyJob(slot.job_id, epoch, bucket, slot_id)
        self._num_ready += 1

    def abort_write(self, slot_id: int) -> None:
        slot = self.slots.get(slot_id)
        if slot is None:
            return
        assert slot.state is SlotState.WRITING, slot
        self._credits[slot.writer] -= 1
        self._free_slot(slot)

    def quarantine(self, slot_id: int) -> None:
        """The writer's lease lapsed while it may still be writing: keep the slot (and the writer's
        credit) out of use until the writer is known gone. The seqlock assumes one writer."""
        slot = self.slots.get(slot_id)
        if slot is None:
            return
        assert slot.state is SlotState.WRITING, slot
        slot.state, slot.job_id = SlotState.QUARANTINED, None

    def release_quarantined(self, writer: str) -> int:
        """``writer`` is gone (exited, left, or registered again): its quarantined slots are free."""
        released = 0
        for slot in self.slots.values():
            if slot.state is SlotState.QUARANTINED and slot.writer == writer:
                self._credits[writer] -= 1
                self._free_slot(slot)
                released += 1
        return released

    # -- drafters ---------------------------------------------------------------------------
    def has_free_slot(self) -> bool:
        return any(self._free.values())

    def has_ready(self, epoch: int) -> bool:
        return epoch in self._ready and any(self._ready[epoch].values())

    @property
    def effective_min_ready(self) -> int:
        """min_ready, capped by what the slots that exist can hold ready while a target writes the next
        (with cuda_ipc the pool is only the slots live targets registered)."""
        return max(1, min(self.min_ready, len(self.slots) - 1))

    def may_serve(self, draining: bool) -> bool:
        """The min-ready reservoir: keep a mix to choose from unless the epoch's tail drains."""
        return self._num_ready > 0 and (draining or self._num_ready >= self.effective_min_ready)

    def eligible(self, epoch: int, *, totals: dict[int, int], taken: Counter) -> dict[int, float]:
        """Buckets a drafter may be given now (see eligible_buckets); all ready ones for pull=random."""
        ready = [b for b, jobs in self._ready[epoch].items() if jobs]
        if self.pull == "random":
            return dict.fromkeys(ready, 0.0)
        return eligible_buckets(ready, totals=totals, taken=taken)

    def pick(self, epoch: int, *, eligible: dict[int, float], window: set[int]) -> ReadyJob:
        per_bucket = self._ready[epoch]
        if self.pull == "random":
            choices = [job for jobs in per_bucket.values() for job in jobs.values()]
            return self.rng.choice(sorted(choices, key=lambda j: j.job_id))
        jobs = per_bucket[choose_bucket(eligible, window=window, rng=self.rng)]
        return jobs[self.rng.choice(sorted(jobs))]

    def begin_read(self, ready: ReadyJob) -> None:
        slot = self.slots[ready.slot]
        self._unindex(slot)
        slot.state = SlotState.READING

    def unread(self, slot_id: int, *, epoch: int, bucket: int) -> None:
        """The reader died before copying the slot out: it is ready again."""
        slot = self.slots[slot_id]
        assert slot.state is SlotState.READING, slot
        slot.state = SlotState.READY
        self._ready[epoch][bucket][slot.job_id] = ReadyJob(slot.job_id, epoch, bucket, slot_id)
        self._num_ready += 1

    def release(self, slot_id: int) -> None:
        slot = self.slots.get(slot_id)
        if slot is not None:
            assert slot.state is SlotState.READING, slot
            self._free_slot(slot)

    def discard_ready(self, slot_id: int) -> None:
        """A ready slot whose data cannot be trusted (a reader found it stale): free it."""
        slot = self.slots.get(slot_id)
        if slot is None:
            return
        if slot.state is SlotState.READY:
            self._unindex(slot)
        self._free_slot(slot)

    def _unindex(self, slot: Slot) -> None:
        for per_bucket in self._ready.values():
            for jobs in per_bucket.values():
                if jobs.pop(slot.job_id, None) is not None:
                    self._num_ready -= 1
                    return

    def _free_slot(self, slot: Slot) -> None:
        slot.state, slot.job_id, slot.writer = SlotState.FREE, None, None
        self._free[slot.owner].append(slot.id)
