"""A log-scale latency histogram: constant memory however many calls it sees.

A benchmark that times millions of calls must not keep them: the histogram counts each call in
a bin whose width is a fixed fraction of its value (``BINS_PER_OCTAVE`` bins per doubling, so a
quantile is off by at most ~2 %), and keeps the exact maximum on the side.
"""

from __future__ import annotations

import math

BINS_PER_OCTAVE = 32   # bin width 2**(1/32) - 1 = 2.2 % of the value: finer costs memory, coarser costs accuracy
LOWEST_S = 1e-7        # calls faster than 0.1 µs share the first bin
NUM_OCTAVES = 34       # up to 0.1 µs * 2**34, about half an hour


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (BINS_PER_OCTAVE * NUM_OCTAVES + 1)
        self.num_calls = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        self.num_calls += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds
        index = int(math.log2(seconds / LOWEST_S) * BINS_PER_OCTAVE) + 1 if seconds > LOWEST_S else 0
        self.counts[min(index, len(self.counts) - 1)] += 1

    def merge(self, other: "LatencyHistogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.num_calls += other.num_calls
        self.total_s += other.total_s
        self.max_s = max(self.max_s, other.max_s)

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding the ``q`` quantile (never above the exact maximum)."""
        if not self.num_calls:
            return 0.0
        rank = math.ceil(q * self.num_calls)
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                edge = LOWEST_S * 2 ** (index / BINS_PER_OCTAVE)
                return min(edge, self.max_s)
        return self.max_s
