"""Fairness figures of a bucket sequence (definitions in DESIGN.md).

Both take a sequence of bucket ids (a job list, or the order in which jobs were consumed) and the
per-bucket totals of the whole epoch, so that a partial stream is measured against the epoch's
shares rather than against itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np


def bucket_totals(order: Sequence[int]) -> dict[int, int]:
    return dict(Counter(order))


class PrefixDeviation:
    """prefix deviation of a stream that grows one job at a time, in O(1) per job.

    The dispatcher keeps one per epoch for the consumed stream, so stats and metrics never rescan
    an epoch of 100,000 jobs; ``value`` (read a few times a second) costs O(buckets).

    Between two jobs of bucket b, count_b - t * share_b only falls: its largest value is right after
    a job of b, its most negative one right before b's next job (or now). So each job settles those
    two of its own bucket, and ``value`` adds every bucket's current shortfall. A give-back breaks
    that order: the job after one measures every bucket (the plain way), and the order holds again
    from there.
    """

    def __init__(self, totals: dict[int, int]):
        num_jobs = sum(totals.values())
        self.shares = {b: n / num_jobs for b, n in totals.items()} if num_jobs else {}
        self.counts: Counter = Counter()
        self.length = 0
        self._settled = 0.0  # the worst deviation of the states no longer current
        self._after_give_back = False

    @property
    def value(self) -> float:
        if self._after_give_back:  # the state a give-back left is not measured: the figure as it was
            return self._settled
        length, get, worst = self.length, self.counts.get, self._settled
        for b, share in self.shares.items():
            shortfall = length * share - get(b, 0)
            if shortfall > worst:
                worst = shortfall
        return worst

    def add(self, bucket: int) -> None:
        counts, share = self.counts, self.shares.get(bucket)
        before = counts[bucket]
        self.length = length = self.length + 1
        counts[bucket] = before + 1
        if self._after_give_back:
            self._measure_every_bucket(bucket)
            return
        worst = self._settled
        if share is None:  # a bucket the totals do not know counts fully against them
            if before + 1 > worst:
                worst = before + 1
        else:
            shortfall = (length - 1) * share - before  # in the previous state: the deepest since b's last job
            if shortfall > worst:
                worst = shortfall
            deviation = before + 1 - length * share
            if deviation > worst:
                worst = deviation
        self._settled = worst

    def _measure_every_bucket(self, bucket: int) -> None:
        counts, length = self.counts, self.length
        value = self._settled
        if bucket not in self.shares:
            value = max(value, counts[bucket])
        for b, share in self.shares.items():  # max(value, abs(...)) without two calls per bucket
            deviation = counts.get(b, 0) - length * share
            if deviation > value:
                value = deviation
            elif -deviation > value:
                value = -deviation
        self._settled, self._after_give_back = value, False

    def add_many(self, bucket: int, count: int) -> None:
        """``count`` jobs of ``bucket`` in a row: the same figure as ``count`` calls of :meth:`add`.
        Over such a run each count_b(t) - t * share_b is linear in t: the run's first job settles
        what it must, its last one the bucket's new count."""
        if count <= 0:
            return
        self.add(bucket)
        if count == 1:
            return
        self.length += count - 1
        last = self.counts[bucket] = self.counts[bucket] + count - 1
        share = self.shares.get(bucket)
        self._settled = max(self._settled, last if share is None else last - self.length * share)

    def remove(self, bucket: int) -> None:
        """Take back one job of ``bucket`` (a give-back). The figure keeps the worst prefix seen so far:
        recomputing it exactly would rescan the stream, and a give-back is the exception."""
        self._settled = self.value
        self._after_give_back = True
        self.length -= 1
        self.counts[bucket] -= 1


def prefix_deviation(order: Sequence[int], totals: dict[int, int] | None = None) -> float:
    """max over prefixes t and buckets b of |count_b(t) - t * n_b / N|, in batches."""
    tracker = PrefixDeviation(totals or bucket_totals(order))
    for bucket in order:
        tracker.add(bucket)
    return tracker.value


def prefix_deviation_array(order: np.ndarray, totals: dict[int, int] | None = None) -> float:
    """The same figure as :func:`prefix_deviation`, vectorized: one pass per bucket over the array."""
    order = np.asarray(order)
    if totals is None:
        totals = bucket_totals(order.tolist())
    num_jobs = sum(totals.values())
    if num_jobs == 0 or len(order) == 0:
        return 0.0
    t = np.arange(1, len(order) + 1, dtype=np.float64)
    worst = 0.0
    for bucket in set(totals) | set(np.unique(order).tolist()):
        counts = np.cumsum(order == bucket, dtype=np.float64)
        worst = max(worst, float(np.abs(counts - t * totals.get(bucket, 0) / num_jobs).max()))
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
