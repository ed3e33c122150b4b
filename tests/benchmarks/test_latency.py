"""The benchmarks' latency histogram: quantiles within a bin's width of the exact ones, across folds."""

from __future__ import annotations

import numpy as np

from benchmarks.latency import BINS_PER_OCTAVE, FOLD_EVERY, LatencyHistogram

BIN_WIDTH = 2 ** (1 / BINS_PER_OCTAVE)


def test_quantiles_match_the_exact_ones_within_a_bin():
    rng = np.random.default_rng(0)
    durations = rng.lognormal(mean=np.log(20e-6), sigma=1.0, size=3 * FOLD_EVERY + 17)  # unbinned calls left over
    hist = LatencyHistogram()
    for d in durations.tolist():
        hist.add(d)
    assert hist.num_calls == len(durations)
    assert hist.max_s == durations.max()
    assert abs(hist.total_s - durations.sum()) < 1e-9
    for q in (0.5, 0.9, 0.99, 0.999):
        exact = np.quantile(durations, q, method="inverted_cdf")
        assert exact <= hist.quantile(q) <= exact * BIN_WIDTH * (1 + 1e-9)
    assert hist.quantile(1.0) == durations.max()


def test_merge_is_the_histogram_of_both_and_tiny_calls_share_the_first_bin():
    first, second, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, d in enumerate([1e-9, 5e-8, 3e-6, 4e-4, 2e-2] * 1000):
        (first if i % 3 else second).add(d)
        both.add(d)
    first.merge(second)
    assert first.num_calls == both.num_calls == 5000
    assert (first.counts == both.counts).all()
    assert first.quantile(0.3) == both.quantile(0.3) <= 1e-7  # the two calls below 0.1 µs are 40 %
    assert LatencyHistogram().quantile(0.5) == 0.0
