"""The epoch schedule: length buckets, fixed-token batches, one linear job list per epoch.

Pure code. ``build_epoch_schedule`` is a function of (sample lengths, bucket boundaries, token
budget, run seed, epoch, order kind) only, so the same inputs always give the same list; the
dispatcher persists the result before serving the first job and a restart reads it back.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from dispatcher.fairness import prefix_deviation, tail_skew

ORDERS = ("interleave", "shuffle")


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


@dataclass(frozen=True)
class EpochSchedule:
    epoch: int
    seed: int
    order_kind: str
    tokens_per_batch: int
    buckets: tuple[Bucket, ...]
    batches: tuple[Batch, ...]  # in job order: job index i is batches[i]
    num_dropped: int  # samples longer than the last bucket

    @property
    def bucket_order(self) -> list[int]:
        return [batch.bucket for batch in self.batches]

    def figures(self) -> dict[str, float]:
        order = self.bucket_order
        return {"prefix_deviation": prefix_deviation(order), "tail_skew": tail_skew(order)}

    def summary(self) -> dict:
        """The JSON shape printed by ``hsd schedule --json``."""
        return {"epoch": self.epoch, "order_kind": self.order_kind, "num_jobs": len(self.batches),
                "num_dropped": self.num_dropped, "buckets": [asdict(b) for b in self.buckets],
                "order": self.bucket_order, **self.figures()}

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "order_kind": self.order_kind,
                "tokens_per_batch": self.tokens_per_batch, "num_dropped": self.num_dropped,
                "buckets": [asdict(b) for b in self.buckets],
                "batches": [[b.bucket, list(b.samples)] for b in self.batches]}

    @classmethod
    def from_json(cls, doc: dict) -> "EpochSchedule":
        return cls(epoch=doc["epoch"], seed=doc["seed"], order_kind=doc["order_kind"],
                   tokens_per_batch=doc["tokens_per_batch"], num_dropped=doc["num_dropped"],
                   buckets=tuple(Bucket(**b) for b in doc["buckets"]),
                   batches=tuple(Batch(bucket, tuple(samples)) for bucket, samples in doc["batches"]))


def epoch_seed(run_seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"hsdispatch/{run_seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def assign_buckets(lengths: Sequence[int], bucket_max_lens: Sequence[int]) -> list[int]:
    """Bucket index of each sample: the first bucket whose max length holds it; -1 when none does."""
    last = len(bucket_max_lens)
    out = []
    for length in lengths:
        b = bisect.bisect_left(bucket_max_lens, length)
        out.append(b if b < last else -1)
    return out


def interleave_order(counts: Sequence[int], rng: random.Random) -> list[int]:
    """Largest-deficit order: at each position the bucket whose count lags its share the most.

    Each bucket starts from a random phase in [0, 1) of a batch, drawn per epoch, so epochs with
    equal bucket counts still get different orders; the phase shifts every prefix by less than one
    batch, which keeps the prefix deviation within about one batch per bucket. Exact ties fall to a
    seeded random priority.
    """
    total = sum(counts)
    shares = [c / total for c in counts] if total else []
    phase = [rng.random() for _ in counts]
    priority = list(range(len(counts)))
    rng.shuffle(priority)
    taken = [0] * len(counts)
    order = []
    for t in range(1, total + 1):
        best, best_key = -1, None
        for b, count in enumerate(counts):
            if taken[b] == count:
                continue
            key = (t * shares[b] - taken[b] + phase[b] - 0.5, priority[b])
            if best_key is None or key > best_key:
                best, best_key = b, key
        taken[best] += 1
        order.append(best)
    return order


def shuffle_order(counts: Sequence[int], rng: random.Random) -> list[int]:
    order = [b for b, count in enumerate(counts) for _ in range(count)]
    rng.shuffle(order)
    return order


def build_epoch_schedule(lengths: Sequence[int], *, bucket_max_lens: Sequence[int], tokens_per_batch: int,
                         run_seed: int, epoch: int, order: str = "interleave") -> EpochSchedule:
    if order not in ORDERS:
        raise ValueError(f"unknown schedule order {order!r} (known: {', '.join(ORDERS)})")
    seed = epoch_seed(run_seed, epoch)
    rng = random.Random(seed)
    sample_ids = list(range(len(lengths)))
    rng.shuffle(sample_ids)
    assignment = assign_buckets(lengths, bucket_max_lens)
    members: list[list[int]] = [[] for _ in bucket_max_lens]
    for sample in sample_ids:
        if assignment[sample] >= 0:
            members[assignment[sample]].append(sample)
    # Chunking the shuffled members gives each bucket its batches already in random order.
    per_bucket: list[list[Batch]] = []
    buckets = []
    for b, max_len in enumerate(bucket_max_lens):
        batch_size = tokens_per_batch // max_len
        chunks = [Batch(b, tuple(members[b][i:i + batch_size])) for i in range(0, len(members[b]), batch_size)]
        per_bucket.append(chunks)
        buckets.append(Bucket(id=b, max_len=max_len, batch_size=batch_size, num_batches=len(chunks),
                              num_samples=len(members[b])))
    counts = [len(chunks) for chunks in per_bucket]
    bucket_sequence = (interleave_order if order == "interleave" else shuffle_order)(counts, rng)
    cursors = [0] * len(counts)
    batches = []
    for b in bucket_sequence:
        batches.append(per_bucket[b][cursors[b]])
        cursors[b] += 1
    return EpochSchedule(epoch=epoch, seed=seed, order_kind=order, tokens_per_batch=tokens_per_batch,
                         buckets=tuple(buckets), batches=tuple(batches), num_dropped=assignment.count(-1))


def schedule_path(run_dir: str | os.PathLike, epoch: int) -> Path:
    return Path(run_dir) / "schedule" / f"epoch-{epoch:04d}.json"


def save_schedule(schedule: EpochSchedule, run_dir: str | os.PathLike) -> Path:
    """Write atomically and durably: the schedule must exist before its first job is served."""
    path = schedule_path(run_dir, schedule.epoch)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(schedule.to_json(), f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_schedule(run_dir: str | os.PathLike, epoch: int) -> EpochSchedule | None:
    path = schedule_path(run_dir, epoch)
    if not path.exists():
        return None
    return EpochSchedule.from_json(json.loads(path.read_text()))
