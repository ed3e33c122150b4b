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
- Nodes (``pool.transport=nixl``): each slot lives on its owner's node, and the reservoir holds per
  node: a node's slots are handed out only while ``min_ready`` of them are ready (capped by what
  that node has). With ``locality=prefer`` the bucket is chosen as on one node, and the node
  decides which slot: one of the drafter's own node when that bucket has one there, else a local
  slot of an eligible bucket lagging at most LOCAL_SLACK less, else another node's (the fairness
  bound asks for it). A drafter whose node has no slot it may take at all reads another node's
  once it has waited ``remote_after_s`` (its starvation asks for it). Two symmetric nodes through
  the core (tests/dispatcher/test_pool_nodes.py) consume within LOCAL_SLACK of one node's prefix
  deviation with over 90% of the reads local. Slots of the
  dispatcher's own arena (``node`` None) are local to every reader.
"""

from __future__ import annotations

import enum
import random
from bisect import bisect_left, insort
from collections import Counter, defaultdict
from dataclasses import dataclass
from heapq import merge
from itertools import chain
from typing import Any, Iterable, NamedTuple, get_args

from common.run.config import Locality, Pull

PULL_POLICIES = get_args(Pull)  # pool.pull's choices
LOCALITY_POLICIES = get_args(Locality)  # nodes.locality's


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
    node: str | None = None  # the node whose memory holds it; None: the dispatcher's arena, local to all


class ReadyJob(NamedTuple):
    """A ready slot as the index holds it: one is made per job (a frozen dataclass cost three times as much)."""
    job_id: int
    epoch: int
    bucket: int
    slot: int
    node: str | None = None

    def local_to(self, node: str | None) -> bool:
        return self.node is None or node is None or self.node == node


# A bucket may run ahead of its share of the consumed stream by less than this many batches when
# the drafter's accumulation window asks for a bucket it has not used yet. It is what lets every
# step mix lengths while each prefix of the consumed stream stays proportional.
MIX_SLACK = 1.0
# A bucket lagging its share by this many batches is served first, window or not: mixing never
# lets the dominant bucket fall behind by more.
MAX_LAG = 1.5
# With nodes: when the bucket fairness picks has no slot on the drafter's node, a local slot of an
# eligible bucket lagging at most this many batches less is taken instead of a remote read. 0 keeps
# the consumed stream exactly as on one node; more keeps more reads local.
LOCAL_SLACK = 0.25
_NO_DEFICIT = float("-inf")


def eligible_buckets(candidates: Iterable[int], *, totals: dict[int, int], taken: Counter,
                     num_jobs: int | None = None, num_taken: int | None = None) -> dict[int, float]:
    """Ready buckets not already ahead of their share by MIX_SLACK, with their consumption deficit.

    A bucket lagging by MAX_LAG or more, or (when every ready bucket is ahead) the least-ahead one,
    is eligible alone. ``num_jobs``/``num_taken``: the sums of ``totals``/``taken``, when the caller
    keeps them.
    """
    num_jobs = sum(totals.values()) if num_jobs is None else num_jobs
    position = (sum(taken.values()) if num_taken is None else num_taken) + 1
    deficits = {}
    best = _NO_DEFICIT
    for b in candidates:  # one pass for the deficits and their largest: asked by every get_hs
        deficit = deficits[b] = position * totals.get(b, 0) / num_jobs - taken.get(b, 0)
        if deficit > best:
            best = deficit
    if best < MAX_LAG:
        eligible = {b: d for b, d in deficits.items() if d > -MIX_SLACK}
        if eligible or not deficits:
            return eligible
    return {b: d for b, d in deficits.items() if d >= best - 1e-9}


def choose_bucket(deficits: dict[int, float], *, window: set[int], rng: random.Random,
                  available: dict[int, Any] | None = None) -> int | None:
    """Largest deficit among the eligible buckets, those outside the drafter's window first; ties
    drawn from ``rng``. ``available``: only the buckets it maps to something truthy (a ready job)
    count. None when no bucket counts. One pass: every get_hs asks."""
    best_fresh = best_any = _NO_DEFICIT
    for b, d in deficits.items():
        if available is None or available.get(b):
            if d > best_any:
                best_any = d
            if d > best_fresh and b not in window:
                best_fresh = d
    if best_any == _NO_DEFICIT:
        return None
    fresh_only = best_fresh != _NO_DEFICIT
    floor = (best_fresh if fresh_only else best_any) - 1e-9
    tied = [b for b, d in deficits.items() if d >= floor and (available is None or available.get(b))
            and not (fresh_only and b in window)]
    tied.sort()
    return rng.choice(tied)


class HSPool:
    def __init__(self, *, min_ready: int, target_credits: int, pull: str = "deficit", seed: int = 0,
                 num_buckets: int = 0, locality: str = "prefer", remote_after_s: float = 0.0):
        if pull not in PULL_POLICIES:
            raise ValueError(f"unknown pull policy {pull!r} (known: {', '.join(PULL_POLICIES)})")
        if locality not in LOCALITY_POLICIES:
            raise ValueError(f"unknown locality policy {locality!r} (known: {', '.join(LOCALITY_POLICIES)})")
        self.locality = locality
        self.remote_after_s = remote_after_s
        self.min_ready = min_ready
        self.target_credits = target_credits
        self.pull = pull
        # every bucket of the schedule is listed in ready_per_bucket, empty ones as 0: a watcher's
        # series for a bucket must not vanish while that bucket has nothing ready
        self.num_buckets = num_buckets
        self.rng = random.Random(seed)
        self.slots: dict[int, Slot] = {}
        self._free: dict[str | None, list[int]] = defaultdict(list)  # owner -> free slot ids
        self._num_free = 0  # over every owner
        self._credits: Counter = Counter()  # target -> slots it is writing
        self._ready: dict[int, dict[int, dict[int, ReadyJob]]] = defaultdict(lambda: defaultdict(dict))
        # the same job ids, each bucket's in order: a pick draws one by its rank without sorting them
        self._ready_ids: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        # ... and each bucket's by node for the slots that live on one (not the arena's), in order, no
        # empty list kept: a pick restricted to some nodes (servable, local) merges their lists
        # instead of walking every ready slot
        self._ready_ids_on: dict[int, dict[int, dict[str | None, list[int]]]] = defaultdict(
            lambda: defaultdict(dict))
        self._num_ids_on: Counter = Counter()  # (epoch, bucket) -> the ids listed in _ready_ids_on
        self._num_ready = 0
        self._ready_on: Counter = Counter()  # node -> its ready slots
        self._num_ready_on_nodes = 0  # ready slots that live on a node (not the dispatcher's arena)
        self._ready_at: dict[int, tuple[int, int]] = {}  # ready slot -> (epoch, bucket) it is indexed under
        self._ready_in: Counter = Counter()  # epoch -> its ready slots
        self._slots_on: Counter = Counter()  # node -> its slots
        self.peak_in_use = 0  # most slots ever held by a job at once (writing, ready or reading)

    # -- slots ------------------------------------------------------------------------------
    def add_slots(self, slot_ids: Iterable[int], owner: str | None = None, node: str | None = None) -> None:
        for slot_id in slot_ids:
            if slot_id in self.slots:
                raise ValueError(f"slot {slot_id} already in the pool")
            self.slots[slot_id] = Slot(slot_id, owner, node=node)
            self._free[owner].append(slot_id)
            self._num_free += 1
            self._slots_on[node] += 1

    def remove_owner(self, owner: str) -> list[Slot]:
        """The owner's memory is gone: drop its slots; returns those that held a job."""
        lost = []
        for slot in [s for s in self.slots.values() if s.owner == owner]:
            if slot.state is SlotState.READY:
                self._unindex(slot)
            if slot.job_id is not None:
                lost.append(slot)
            del self.slots[slot.id]
            self._slots_on[slot.node] -= 1
        self._num_free -= len(self._free.pop(owner, ()))
        return lost

    @property
    def num_ready(self) -> int:
        return self._num_ready

    def counts(self) -> dict[str, int]:
        counts = Counter(slot.state.value for slot in self.slots.values())
        return {state.value: counts.get(state.value, 0) for state in SlotState}

    def node_counts(self) -> dict[str | None, dict[str, int]]:
        """Per node: its slots in each state."""
        out: dict[str | None, Counter] = defaultdict(Counter)
        for slot in self.slots.values():
            out[slot.node][slot.state.value] += 1
        return {node: {state.value: counts.get(state.value, 0) for state in SlotState}
                for node, counts in out.items()}

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
        self._num_free -= 1
        slot.state, slot.job_id, slot.writer = SlotState.WRITING, job_id, target
        slot.generation += 1
        self._credits[target] += 1
        self.peak_in_use = max(self.peak_in_use, len(self.slots) - self._num_free)
        return slot.generation

    def publish(self, slot_id: int, *, epoch: int, bucket: int) -> None:
        slot = self.slots[slot_id]
        assert slot.state is SlotState.WRITING, slot
        self._credits[slot.writer] -= 1
        slot.state, slot.writer = SlotState.READY, None
        self._index(slot, epoch, bucket)

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
        return self._num_free > 0

    def has_ready(self, epoch: int) -> bool:
        return self._ready_in.get(epoch, 0) > 0

    def ready_on(self, node: str | None) -> int:
        """Ready slots living on ``node`` (None: the dispatcher's arena)."""
        return self._ready_on[node]

    @property
    def effective_min_ready(self) -> int:
        """min_ready, capped by what the slots that exist can hold ready while a target writes the next
        (with cuda_ipc the pool is only the slots live targets registered)."""
        return max(1, min(self.min_ready, len(self.slots) - 1))

    def node_min_ready(self, node: str | None) -> int:
        """The reservoir of one node: min_ready capped by the slots that node has."""
        return max(1, min(self.min_ready, self._slots_on[node] - 1))

    def servable_nodes(self, draining: bool) -> set[str | None]:
        """Nodes whose ready slots may be handed out now: the min-ready reservoir, held per node."""
        min_ready, slots_on = self.min_ready, self._slots_on  # node_min_ready, inlined: asked by every get_hs
        return {node for node, ready in self._ready_on.items()
                if ready > 0 and (draining or ready >= max(1, min(min_ready, slots_on[node] - 1)))}

    def may_serve(self, draining: bool) -> bool:
        """The min-ready reservoir: keep a mix to choose from unless the epoch's tail drains."""
        return bool(self.servable_nodes(draining))

    def eligible(self, epoch: int, *, totals: dict[int, int], taken: Counter, num_jobs: int | None = None,
                 num_taken: int | None = None) -> dict[int, float]:
        """Buckets a drafter may be given now (see eligible_buckets); all ready ones for pull=random."""
        ready = [b for b, jobs in self._ready[epoch].items() if jobs]
        if self.pull == "random":
            return dict.fromkeys(ready, 0.0)
        return eligible_buckets(ready, totals=totals, taken=taken, num_jobs=num_jobs, num_taken=num_taken)

    def pick(self, epoch: int, *, eligible: dict[int, float], window: set[int], node: str | None = None,
             servable: set[str | None] | None = None, waited_s: float = 0.0) -> ReadyJob | None:
        """The job for a drafter of ``node`` (see the module docstring), or None: it waits for a local one.

        ``servable``: the nodes whose slots may be handed out (default: every node); ``waited_s``: how
        long the drafter has waited for a slot so far.
        """
        if self.pull == "deficit" and not self._num_ready_on_nodes and (servable is None or None in servable):
            # Every ready slot is the dispatcher's arena, local to every reader and servable: what the
            # general path below picks, without its per-slot filters.
            ready = self._ready[epoch]
            bucket = choose_bucket(eligible, window=window, rng=self.rng, available=ready)
            if bucket is None:
                return None
            return ready[bucket][self.rng.choice(self._ready_ids[epoch][bucket])]
        # Candidates are job ids in order, per bucket: those on servable nodes, then those local to the
        # drafter; a draw takes one by its rank (as sorting the slots would order them).
        ready = self._ready[epoch]
        blocked = frozenset() if servable is None else frozenset(
            n for n, count in self._ready_on.items() if count and n not in servable)
        candidates = {b: ids for b in (ready if self.pull == "random" else eligible)
                      if (ids := self._ids_on(epoch, b, blocked))}
        if not candidates:
            return None
        if self.locality == "prefer" and node is not None:
            local = {b: ids for b in candidates if (ids := self._ids_on(epoch, b, blocked, near=node))}
            if not local and waited_s < self.remote_after_s:
                return None
            if self.pull == "deficit":
                # The bucket as on one node; the node only decides which of its slots.
                bucket = choose_bucket(eligible, window=window, rng=self.rng, available=candidates)
                if bucket not in local:
                    # never trading a bucket new to the drafter's window for one it holds: steps stay mixed
                    near = {b: eligible[b] for b in local if eligible[b] >= eligible[bucket] - LOCAL_SLACK
                            and (b not in window or bucket in window)}
                    if near:
                        bucket = choose_bucket(near, window=window, rng=self.rng)
                return ready[bucket][self.rng.choice(local.get(bucket) or candidates[bucket])]
            if local:
                candidates = local
        if self.pull == "random":
            where = {job_id: b for b, ids in candidates.items() for job_id in ids}
            job_id = self.rng.choice(sorted(where))
            return ready[where[job_id]][job_id]
        bucket = choose_bucket(eligible, window=window, rng=self.rng, available=candidates)
        return ready[bucket][self.rng.choice(candidates[bucket])]

    def _ids_on(self, epoch: int, bucket: int, blocked: frozenset, *, near: str | None = None) -> list[int]:
        """The ready job ids of ``bucket`` in order, on nodes not ``blocked`` (below their reservoir);
        with ``near``, only those local to a drafter of that node (its own and the arena's). The list
        may be the index's own: read it, never change it."""
        every = self._ready_ids[epoch].get(bucket)
        if not every:
            return []
        per_node = self._ready_ids_on[epoch].get(bucket) or {}
        if self._num_ids_on[epoch, bucket] < len(every):  # some are the arena's: listed under None
            on_nodes = set(chain.from_iterable(per_node.values()))
            per_node = {**per_node, None: [job_id for job_id in every if job_id not in on_nodes]}
        if near is None:
            if blocked.isdisjoint(per_node):
                return every
            lists = [ids for n, ids in per_node.items() if n not in blocked]
        else:
            lists = [ids for n in (near, None) if n not in blocked and (ids := per_node.get(n))]
        if len(lists) <= 1:
            return lists[0] if lists else []
        return list(merge(*lists))

    def begin_read(self, ready: ReadyJob) -> None:
        slot = self.slots[ready.slot]
        self._unindex(slot)
        slot.state = SlotState.READING

    def unread(self, slot_id: int, *, epoch: int, bucket: int) -> None:
        """The reader died before copying the slot out: it is ready again."""
        slot = self.slots[slot_id]
        assert slot.state is SlotState.READING, slot
        slot.state = SlotState.READY
        self._index(slot, epoch, bucket)

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

    def _index(self, slot: Slot, epoch: int, bucket: int) -> None:
        jobs = self._ready[epoch][bucket]
        if slot.job_id not in jobs:
            insort(self._ready_ids[epoch][bucket], slot.job_id)
            if slot.node is not None:
                insort(self._ready_ids_on[epoch][bucket].setdefault(slot.node, []), slot.job_id)
                self._num_ids_on[epoch, bucket] += 1
        jobs[slot.job_id] = ReadyJob(slot.job_id, epoch, bucket, slot.id, slot.node)
        self._ready_at[slot.id] = (epoch, bucket)
        self._ready_in[epoch] += 1
        self._num_ready += 1
        self._ready_on[slot.node] += 1
        self._num_ready_on_nodes += slot.node is not None

    def _unindex(self, slot: Slot) -> None:
        where = self._ready_at.pop(slot.id, None)
        if where is not None and self._ready[where[0]][where[1]].pop(slot.job_id, None) is not None:
            ids = self._ready_ids[where[0]][where[1]]
            del ids[bisect_left(ids, slot.job_id)]
            if slot.node is not None:
                per_node = self._ready_ids_on[where[0]][where[1]]
                ids = per_node[slot.node]
                del ids[bisect_left(ids, slot.job_id)]
                if not ids:
                    del per_node[slot.node]
                self._num_ids_on[where] -= 1
            self._ready_in[where[0]] -= 1
            self._num_ready -= 1
            self._ready_on[slot.node] -= 1
            self._num_ready_on_nodes -= slot.node is not None

    def _free_slot(self, slot: Slot) -> None:
        slot.state, slot.job_id, slot.writer = SlotState.FREE, None, None
        self._free[slot.owner].append(slot.id)
        self._num_free += 1
