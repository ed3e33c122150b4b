"""The epoch schedule: length buckets, fixed-token batches, one linear job list per epoch.

Pure code. ``build_epoch_schedule`` is a function of (sample lengths, bucket boundaries, token
budget, run seed, epoch, order kind) only, so the same inputs always give the same list; the
dispatcher persists the result before serving the first job and a restart reads it back.

A schedule is three flat arrays, not one object per job, so an epoch of a million jobs is built in
about a second, written as a few ``.npy`` files, and read back memory-mapped:

- ``job_bucket[i]``: the bucket of job ``i``;
- ``job_offsets[i]:job_offsets[i + 1]``: the slice of ``job_samples`` holding job ``i``'s samples.

Batch formation (``batching``). A batch's sequences are right-padded to one length, so the share
of real tokens in a slot (its *fill*) depends on how alike their lengths are:

- ``sorted`` (the default): each bucket's samples are sorted longest first and cut into batches
  greedily: a batch takes the next samples while ``count × its longest <= tokens_per_batch`` and
  ``count <= max_seqs``, and is padded only to its own longest sample. A batch thus holds samples
  of nearly one length, and a bucket's batches are dealt out in a random order. About 0.92 of a
  slot's tokens are real on a lognormal chat mix, against 0.70 for ``fixed`` (README, ``hsd bench
  target``).

  The sort is by *size class* first, ``min(tokens_per_batch // length, max_seqs)``: the size the
  greedy cut gives a batch that starts at a sample of that length. The cut depends only on the
  sequence of classes, so any order within a class cuts the same batch sizes as the exact length
  sort, and every member fits its batch (it is in the class of the batch's first sample or a later,
  shorter one). Within a class the order is the epoch's own: lengths scaled by a random factor in
  ``[1, 1 + LENGTH_JITTER)``, so neighbours of nearly equal length meet in new batches every epoch
  (an exact sort would put the same samples together epoch after epoch), while the number of
  batches and each bucket's batch sizes stay functions of the lengths alone: the drafter sizes its
  learning-rate schedule up front (:func:`count_batches`).
- ``fixed``: ``tokens_per_batch // L`` random samples per batch of a bucket with max length ``L``,
  padded to ``L`` (the first design; kept for comparison).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence, get_args

import msgspec
import numpy as np

from common.run.config import Batching, Order
from common.run.durable import atomic_write
from common.run.records.fairness import prefix_deviation_array, tail_skew

ORDERS = get_args(Order)  # schedule.order's choices, the default first
BATCHINGS = get_args(Batching)
SCHEDULE_DIR = "schedule"
META_FILE = "meta.json"
# Largest relative change of a length in the within-class order of sorted batching. Larger mixes
# wider neighbourhoods into a batch each epoch, at the cost of padding: on the lognormal mix of the
# README, 0.03 keeps 0.28 of the sample pairs batched together from one epoch to the next (0.61 with
# the exact sort) while padded tokens go from 0.999 to 0.990 real; 0.10 keeps 0.20 at 0.978.
LENGTH_JITTER = 0.03


@dataclass(frozen=True)
class Bucket:
    id: int
    max_len: int
    batch_size: int
    num_batches: int
    num_samples: int


@dataclass(frozen=True)
class Batch:
    bucket: int
    samples: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class EpochSchedule:
    epoch: int
    seed: int
    order_kind: str
    tokens_per_batch: int
    buckets: tuple[Bucket, ...]
    num_dropped: int  # samples longer than the last bucket
    job_bucket: np.ndarray   # [num_jobs] int16
    job_offsets: np.ndarray  # [num_jobs + 1] int64
    job_samples: np.ndarray  # [num_samples kept] int64, sample indices
    saved_figures: dict | None = None  # the figures stored with a persisted schedule
    batching: str = "fixed"  # how batches were formed (BATCHINGS); schedules written before it was recorded are fixed

    def padded_len(self, bucket: int, lengths: Sequence[int]) -> int:
        """The length a batch's sequences are padded to: the bucket's max (fixed) or the batch's longest (sorted)."""
        return self.buckets[bucket].max_len if self.batching == "fixed" else int(max(lengths))

    @property
    def prefix_deviation(self) -> float:
        figures = self.saved_figures or self.figures()
        return figures["prefix_deviation"]

    @property
    def num_jobs(self) -> int:
        return len(self.job_bucket)

    def samples_of(self, index: int) -> list[int]:
        return self.sample_array(index).tolist()

    def sample_array(self, index: int) -> np.ndarray:
        """A job's sample indices as a view of the schedule (indexing another array with it is 3x
        faster than with the list)."""
        offsets = self.job_offsets
        return self.job_samples[offsets.item(index):offsets.item(index + 1)]

    def bucket_of(self, index: int) -> int:
        return int(self.job_bucket[index])

    @property
    def bucket_order(self) -> list[int]:
        return self.job_bucket.tolist()

    @property
    def batches(self) -> tuple[Batch, ...]:
        """One object per job: for small schedules (tests, printing), never on the dispatcher's path."""
        return tuple(Batch(self.bucket_of(i), tuple(self.samples_of(i))) for i in range(self.num_jobs))

    @cached_property
    def bucket_totals(self) -> dict[int, int]:
        counts = np.bincount(self.job_bucket, minlength=len(self.buckets)) if self.num_jobs else []
        return {b: int(n) for b, n in enumerate(counts) if n}

    def fill(self, lengths: np.ndarray) -> tuple[float, dict[int, float]]:
        """Real tokens ÷ slot tokens (``tokens_per_batch`` a job): overall, and per bucket that has jobs."""
        if not self.num_jobs:
            return 0.0, {}
        tokens = np.add.reduceat(np.asarray(lengths)[self.job_samples], self.job_offsets[:-1])
        per_bucket = np.bincount(self.job_bucket, weights=tokens, minlength=len(self.buckets))
        buckets = {b.id: float(per_bucket[b.id] / (b.num_batches * self.tokens_per_batch))
                   for b in self.buckets if b.num_batches}
        return float(per_bucket.sum() / (self.num_jobs * self.tokens_per_batch)), buckets

    def padded_fill(self, lengths: np.ndarray) -> float:
        """Real tokens ÷ padded tokens (each job's sequences times its ``padded_len``): the share of the
        target's and drafter's work on real tokens, where :meth:`fill` is the share of the slots'."""
        if not self.num_jobs:
            return 0.0
        lengths = np.asarray(lengths)[self.job_samples]
        sizes = np.diff(self.job_offsets)
        if self.batching == "fixed":
            padded_lens = np.asarray([b.max_len for b in self.buckets])[self.job_bucket]
        else:
            padded_lens = np.maximum.reduceat(lengths, self.job_offsets[:-1])
        return float(lengths.sum() / (sizes * padded_lens).sum())

    def figures(self) -> dict[str, float]:
        return {"prefix_deviation": prefix_deviation_array(self.job_bucket, self.bucket_totals),
                "tail_skew": tail_skew(self.job_bucket.tolist())}

    def summary(self) -> dict:
        """The JSON shape printed by ``hsd schedule --json``."""
        return {"epoch": self.epoch, "order_kind": self.order_kind, "batching": self.batching,
                "num_jobs": self.num_jobs, "num_dropped": self.num_dropped, "buckets": [asdict(b) for b in self.buckets],
                "order": self.bucket_order, **self.figures()}

    def meta(self) -> ScheduleMeta:
        return ScheduleMeta(epoch=self.epoch, seed=self.seed, order_kind=self.order_kind, batching=self.batching,
                            tokens_per_batch=self.tokens_per_batch, num_dropped=self.num_dropped,
                            num_jobs=self.num_jobs, buckets=self.buckets, figures=self.saved_figures or self.figures())


class ScheduleMeta(msgspec.Struct, kw_only=True):
    """``schedule/epoch-NNNN/meta.json``: what a persisted schedule holds beside its three arrays."""

    epoch: int
    seed: int
    order_kind: str
    batching: str = "fixed"  # schedules written before it was recorded are fixed
    tokens_per_batch: int
    num_dropped: int
    num_jobs: int
    buckets: tuple[Bucket, ...]
    figures: dict[str, float] | None = None  # prefix_deviation and tail_skew when it was built


def max_seqs_per_batch(tokens_per_batch: int, bucket_max_lens: Sequence[int]) -> int:
    """Most sequences one batch (and slot) holds: as many as the shortest bucket's fixed batch. A cap
    rather than what short samples could pack, so a drafter's per-sequence work (anchors) stays bounded."""
    return tokens_per_batch // bucket_max_lens[0]


def pairs_batched_again(first: EpochSchedule, second: EpochSchedule) -> float:
    """Of the sample pairs that share a job in ``first``, the share that share one again in ``second``."""
    num_samples = int(max(first.job_samples.max(initial=-1), second.job_samples.max(initial=-1))) + 1
    job_in_second = np.full(num_samples, -1, dtype=np.int64)
    job_in_second[second.job_samples] = np.repeat(np.arange(second.num_jobs), np.diff(second.job_offsets))
    job_in_first = np.repeat(np.arange(first.num_jobs), np.diff(first.job_offsets))
    sizes = np.diff(first.job_offsets)
    together = int((sizes * (sizes - 1) // 2).sum())
    _, counts = np.unique(job_in_first * (second.num_jobs + 1) + job_in_second[first.job_samples], return_counts=True)
    return float((counts * (counts - 1) // 2).sum() / together) if together else 0.0


def epoch_seed(run_seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"hsdispatch/{run_seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def assign_buckets(lengths: Sequence[int] | np.ndarray, bucket_max_lens: Sequence[int]) -> list[int]:
    """Bucket index of each sample: the first bucket whose max length holds it; -1 when none does."""
    return _assign(np.asarray(lengths, dtype=np.int64), bucket_max_lens).tolist()


def _assign(lengths: np.ndarray, bucket_max_lens: Sequence[int]) -> np.ndarray:
    out = np.searchsorted(np.asarray(bucket_max_lens, dtype=np.int64), lengths, side="left")
    out[out >= len(bucket_max_lens)] = -1
    return out


def interleave_order(counts: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Largest-deficit order: at each position the bucket whose count lags its share the most.

    Each bucket starts from a random phase in [0, 1) of a batch, drawn per epoch, so epochs with
    equal bucket counts still get different orders; the phase shifts every prefix by less than one
    batch, which keeps the prefix deviation within about one batch per bucket. Exact ties fall to a
    seeded random priority. A plain loop over positions (about a second per million jobs): the
    dispatcher builds the next epoch in a process of its own, ahead of time.
    """
    counts = [int(c) for c in counts]
    total = sum(counts)
    num_buckets = len(counts)
    shares = [c / total for c in counts] if total else []
    deficit = [p - 0.5 for p in rng.random(num_buckets).tolist()]  # t * share - taken + phase - 0.5
    priority = rng.permutation(num_buckets).tolist()
    left = list(counts)
    buckets = range(num_buckets)
    order = bytearray(total) if num_buckets <= 256 else [0] * total
    for t in range(total):
        best, best_key = -1, None
        for b in buckets:
            deficit[b] += shares[b]
            if left[b]:
                key = (deficit[b], priority[b])
                if best_key is None or key > best_key:
                    best, best_key = b, key
        deficit[best] -= 1.0
        left[best] -= 1
        order[t] = best
    return np.asarray(order if isinstance(order, list) else np.frombuffer(bytes(order), dtype=np.uint8), dtype=np.int16)


def shuffle_order(counts: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    order = np.repeat(np.arange(len(counts)), np.asarray(counts, dtype=np.int64)).astype(np.int16)
    rng.shuffle(order)
    return order


def sorted_batch_sizes(lengths_desc: np.ndarray, *, tokens_per_batch: int, max_seqs: int) -> np.ndarray:
    """Sizes of the batches cut from lengths sorted longest first: each takes samples while their count
    times its first (longest) length stays within ``tokens_per_batch``, and at most ``max_seqs``."""
    sizes = []
    remaining = lengths_desc.tolist()
    start, total = 0, len(remaining)
    while start < total:
        size = min(tokens_per_batch // remaining[start], max_seqs, total - start)
        sizes.append(size)
        start += size
    return np.asarray(sizes, dtype=np.int64)


def _bucket_batches(lengths: np.ndarray, mine: np.ndarray, *, batching: str, max_len: int, tokens_per_batch: int,
                    max_seqs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(members in batch order, batch sizes) of one bucket whose shuffled members are ``mine``."""
    if batching == "fixed":  # chunks of shuffled members come out in random order already
        batch_size = tokens_per_batch // max_len
        sizes = np.full(-(-len(mine) // batch_size), batch_size, dtype=np.int64)
        if len(mine) % batch_size:
            sizes[-1] = len(mine) % batch_size
        return mine, sizes
    # Size class first (it alone fixes the cut: see the module docstring), then lengths jittered by
    # the epoch's own draw, longest first.
    size_class = np.minimum(tokens_per_batch // lengths[mine], max_seqs)
    jittered = lengths[mine] * (1.0 + LENGTH_JITTER * rng.random(len(mine)))
    members = mine[np.lexsort((-jittered, size_class))]
    sizes = sorted_batch_sizes(lengths[members], tokens_per_batch=tokens_per_batch, max_seqs=max_seqs)
    # Deal the batches out in a random order: else every bucket would run from its longest to its shortest.
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    order = rng.permutation(len(sizes))
    members = np.concatenate([members[bounds[i]:bounds[i + 1]] for i in order]) if len(sizes) else members
    return members, sizes[order]


def count_batches(lengths: Sequence[int] | np.ndarray, *, bucket_max_lens: Sequence[int], tokens_per_batch: int,
                  batching: str) -> int:
    """Jobs of one epoch: the same for every seed and epoch, and what :func:`build_epoch_schedule` makes
    (sorted batching: the exact length sort has the same sequence of size classes as any epoch's order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assignment = _assign(lengths, bucket_max_lens)
    max_seqs = max_seqs_per_batch(tokens_per_batch, bucket_max_lens)
    total = 0
    for b, max_len in enumerate(bucket_max_lens):
        mine = lengths[assignment == b]
        if batching == "fixed":
            total += -(-len(mine) // (tokens_per_batch // max_len))
        else:
            total += len(sorted_batch_sizes(np.sort(mine)[::-1], tokens_per_batch=tokens_per_batch, max_seqs=max_seqs))
    return total


def build_epoch_schedule(lengths: Sequence[int] | np.ndarray, *, bucket_max_lens: Sequence[int],
                         tokens_per_batch: int, run_seed: int, epoch: int, order: str = "interleave",
                         batching: str = "sorted") -> EpochSchedule:
    if order not in ORDERS:
        raise ValueError(f"unknown schedule order {order!r} (known: {', '.join(ORDERS)})")
    if batching not in BATCHINGS:
        raise ValueError(f"unknown batching {batching!r} (known: {', '.join(BATCHINGS)})")
    seed = epoch_seed(run_seed, epoch)
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    shuffled = rng.permutation(len(lengths))
    assignment = _assign(lengths[shuffled], bucket_max_lens)
    max_seqs = max_seqs_per_batch(tokens_per_batch, bucket_max_lens)
    members: list[np.ndarray] = []     # per bucket: its samples, batch after batch
    batch_sizes: list[np.ndarray] = []  # per bucket: the size of each of its batches, in that order
    buckets = []
    for b, max_len in enumerate(bucket_max_lens):
        mine, sizes = _bucket_batches(lengths, shuffled[assignment == b], batching=batching, max_len=max_len,
                                      tokens_per_batch=tokens_per_batch, max_seqs=max_seqs, rng=rng)
        members.append(mine)
        batch_sizes.append(sizes)
        batch_size = tokens_per_batch // max_len if batching == "fixed" else int(sizes.max(initial=0))
        buckets.append(Bucket(id=b, max_len=max_len, batch_size=batch_size, num_batches=len(sizes),
                              num_samples=len(mine)))
    counts = [b.num_batches for b in buckets]
    job_bucket = (interleave_order if order == "interleave" else shuffle_order)(counts, rng)
    # Job i takes its bucket's next batch (the k-th job of a bucket its k-th batch).
    num_jobs = len(job_bucket)
    member_base = np.cumsum([0] + [len(m) for m in members])
    all_members = np.concatenate(members) if members else np.zeros(0, dtype=np.int64)
    sizes = np.empty(num_jobs, dtype=np.int64)
    starts = np.empty(num_jobs, dtype=np.int64)
    for b in range(len(bucket_max_lens)):
        where = np.flatnonzero(job_bucket == b)
        begins = np.concatenate([[0], np.cumsum(batch_sizes[b])[:-1]]).astype(np.int64)
        starts[where] = member_base[b] + begins[:len(where)]
        sizes[where] = batch_sizes[b][:len(where)]
    job_offsets = np.zeros(num_jobs + 1, dtype=np.int64)
    np.cumsum(sizes, out=job_offsets[1:])
    # Gather every job's slice of the members in job order.
    gather = np.repeat(starts - job_offsets[:-1], sizes) + np.arange(int(job_offsets[-1]))
    job_samples = all_members[gather].astype(np.int64)
    return EpochSchedule(epoch=epoch, seed=seed, order_kind=order, tokens_per_batch=tokens_per_batch,
                         buckets=tuple(buckets), num_dropped=int((assignment == -1).sum()),
                         job_bucket=job_bucket.astype(np.int16), job_offsets=job_offsets, job_samples=job_samples,
                         batching=batching)


def schedule_path(run_dir: str | os.PathLike, epoch: int) -> Path:
    return Path(run_dir) / SCHEDULE_DIR / f"epoch-{epoch:04d}"


_ARRAYS = ("job_bucket", "job_offsets", "job_samples")


def save_schedule(schedule: EpochSchedule, run_dir: str | os.PathLike) -> Path:
    """Write atomically and durably: the schedule must exist before its first job is served."""
    path = schedule_path(run_dir, schedule.epoch)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write_files(tmp: Path) -> None:
        tmp.mkdir()
        for name in _ARRAYS:
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, getattr(schedule, name))
        with open(tmp / META_FILE, "w") as f:  # json, not msgspec: a figure that is NaN stays NaN, as it always was
            json.dump(msgspec.to_builtins(schedule.meta()), f)
    return atomic_write(path, write_files, durable=True)  # every file fsynced, then both directories


def load_schedule(run_dir: str | os.PathLike, epoch: int) -> EpochSchedule | None:
    """The persisted schedule of ``epoch`` (arrays memory-mapped), or None if it was never written."""
    path = schedule_path(run_dir, epoch)
    if not (path / META_FILE).exists():
        return None
    meta = msgspec.convert(json.loads((path / META_FILE).read_text()), ScheduleMeta)
    # Plain ndarray views of the mappings: indexing an np.memmap builds a memmap object per slice or
    # element, several times slower, and the dispatcher slices these on every grant.
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r").view(np.ndarray) for name in _ARRAYS}
    return EpochSchedule(epoch=meta.epoch, seed=meta.seed, order_kind=meta.order_kind,
                         tokens_per_batch=meta.tokens_per_batch, num_dropped=meta.num_dropped, buckets=meta.buckets,
                         saved_figures=meta.figures, batching=meta.batching, **arrays)
