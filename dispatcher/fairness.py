"""Fairness figures of a bucket sequence (definitions in DESIGN.md).

Both take a sequence of bucket ids (a job list, or the order in which jobs were consumed) and the
per-bucket totals of the whole epoch, so that a partial stream is measured against the epoch's
shares rather than against itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def bucket_totals(order: Sequence[int]) -> dict[int, int]:
    return dict(Counter(order))


def prefix_deviation(order: Sequence[int], totals: dict[int, int] | None = None) -> float:
    """max over prefixes t and buckets b of |count_b(t) - t * n_b / N|, in batches."""
    totals = totals or bucket_totals(order)
    num_jobs = sum(totals.values())
    if num_jobs == 0:
        return 0.0
    shares = {b: n / num_jobs for b, n in totals.items()}
    counts = dict.fromkeys(totals, 0)
    worst = 0.0
    for t, bucket in enumerate(order, start=1):
        counts[bucket] = counts.get(bucket, 0) + 1
        for b, share in shares.items():
            worst = max(worst, abs(counts[b] - t * share))
        if bucket not in shares:  # a bucket the totals do not know counts fully against them
            worst = max(worst, counts[bucket])
    return worst


def tail_skew(order: Sequence[int], totals: dict[int, int] | None = None, tail_fraction: float = 0.1) -> float:
    """Total variation distance between the bucket mix of the last 10% and the whole epoch."""
    totals = totals or bucket_totals(order)
    num_jobs = sum(totals.values())
    if num_jobs == 0 or not order:
        return 0.0
    tail_len = max(1, round(len(order) * tail_fraction))
    tail = Counter(order[-tail_len:])
    buckets = set(totals) | set(tail)
    return 0.5 * sum(abs(tail.get(b, 0) / tail_len - totals.get(b, 0) / num_jobs) for b in buckets)
