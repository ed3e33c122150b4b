"""A log-scale latency histogram: constant memory however many calls it sees.

A benchmark that times millions of calls must not keep them: the histogram counts each call in
a bin whose width is a fixed fraction of its value (``BINS_PER_OCTAVE`` bins per doubling, so a
quantile is off by at most ~2 %), and keeps the exact maximum on the side.

Timing must cost the timed loop as little as possible (the dispatcher benchmark times calls of
~20 µs): :meth:`LatencyHistogram.add` only appends to a short list, and every ``FOLD_EVERY`` calls
the list is binned at once with numpy.
"""

from __future__ import annotations

import numpy as np

BINS_PER_OCTAVE = 32   # bin width 2**(1/32) - 1 = 2.2 % of the value: finer costs memory, coarser costs accuracy
LOWEST_S = 1e-7        # calls faster than 0.1 µs share the first bin
NUM_OCTAVES = 34       # up to 0.1 µs * 2**34, about half an hour
NUM_BINS = BINS_PER_OCTAVE * NUM_OCTAVES + 1
FOLD_EVERY = 4096      # calls kept unbinned at most


def bin_index(seconds: np.ndarray) -> np.ndarray:
    """The bin of each duration: 0 up to LOWEST_S, then BINS_PER_OCTAVE bins per doubling."""
    with np.errstate(divide="ignore", invalid="ignore"):
        index = np.floor(np.log2(seconds / LOWEST_S) * BINS_PER_OCTAVE).astype(np.int64) + 1
    return np.clip(np.where(seconds > LOWEST_S, index, 0), 0, NUM_BINS - 1)


class LatencyHistogram:
    def __init__(self) -> None:
        self._counts = np.zeros(NUM_BINS, dtype=np.int64)
        self._num_binned = 0
        self._total_binned = 0.0
        self._max_binned = 0.0
        self._unbinned: list[float] = []

    def add(self, seconds: float) -> None:
        unbinned = self._unbinned
        unbinned.append(seconds)
        if len(unbinned) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        if not self._unbinned:
            return
        values = np.asarray(self._unbinned, dtype=np.float64)
        self._unbinned = []
        self._counts += np.bincount(bin_index(values), minlength=NUM_BINS)
        self._num_binned += len(values)
        self._total_binned += float(values.sum())
        self._max_binned = max(self._max_binned, float(values.max()))

    @property
    def counts(self) -> np.ndarray:
        """Calls per bin."""
        self._fold()
        return self._counts

    @property
    def num_calls(self) -> int:
        return self._num_binned + len(self._unbinned)

    @property
    def total_s(self) -> float:
        self._fold()
        return self._total_binned

    @property
    def max_s(self) -> float:
        self._fold()
        return self._max_binned

    def merge(self, other: "LatencyHistogram") -> None:
        self._fold()
        other._fold()
        self._counts += other._counts
        self._num_binned += other._num_binned
        self._total_binned += other._total_binned
        self._max_binned = max(self._max_binned, other._max_binned)

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding the ``q`` quantile (never above the exact maximum)."""
        self._fold()
        if not self._num_binned:
            return 0.0
        rank = max(1, int(np.ceil(q * self._num_binned)))
        index = int(np.searchsorted(np.cumsum(self._counts), rank))
        return min(LOWEST_S * 2 ** (index / BINS_PER_OCTAVE), self._max_binned)
