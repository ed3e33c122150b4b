"""common/run/records/schedule.py: bucketing, fixed token budget, determinism, interleave fairness, persistence."""

import json
import random
from collections import Counter

import numpy as np
import pytest

from common.run.records.fairness import prefix_deviation, prefix_deviation_array, tail_skew
from common.run.records.schedule import (EpochSchedule, assign_buckets, build_epoch_schedule, count_batches, epoch_seed,
                                         interleave_order, load_schedule, pairs_batched_again, save_schedule,
                                         schedule_path)

BUCKETS6 = [256, 512, 1024, 2048, 4096, 8192]
SHARES6 = (0.04, 0.07, 0.10, 0.15, 0.17, 0.47)


def lengths_with_shares(num_samples, buckets, shares, seed=0):
    """Lengths spread over the buckets with the given sample shares (built here, not by the code under test)."""
    rng = random.Random(seed)
    out, lower = [], 0
    for max_len, share in zip(buckets, shares):
        out += [rng.randint(lower + 1, max_len) for _ in range(round(num_samples * share))]
        lower = max_len
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def lengths6():
    return lengths_with_shares(10_000, BUCKETS6, SHARES6, seed=11)


def build(lengths, order="interleave", epoch=0, seed=0, buckets=BUCKETS6, tokens=16384, batching="sorted"):
    return build_epoch_schedule(lengths, bucket_max_lens=buckets, tokens_per_batch=tokens, run_seed=seed,
                                epoch=epoch, order=order, batching=batching)


# -- bucketing ------------------------------------------------------------------------------------

def test_assign_buckets_boundaries():
    buckets = [128, 256, 512]
    lengths = [1, 127, 128, 129, 256, 257, 511, 512, 513, 10_000]
    assert assign_buckets(lengths, buckets) == [0, 0, 0, 1, 1, 2, 2, 2, -1, -1]


def test_too_long_samples_are_dropped_and_counted():
    lengths = [10, 100, 101, 200, 64, 65, 1000]
    schedule = build(lengths, buckets=[64, 100], tokens=200)
    kept = sorted(s for batch in schedule.batches for s in batch.samples)
    assert kept == [0, 1, 4, 5]          # 101, 200, 1000 are longer than the last bucket
    assert schedule.num_dropped == 3
    assert sum(b.num_samples for b in schedule.buckets) == 4
    for batch in schedule.batches:
        for s in batch.samples:
            assert assign_buckets([lengths[s]], [64, 100]) == [batch.bucket]


# -- fixed token budget ---------------------------------------------------------------------------

def test_fixed_token_budget_and_every_sample_once(lengths6):
    schedule = build(lengths6, batching="fixed")
    max_lens = {b.id: b.max_len for b in schedule.buckets}
    assert [b.max_len for b in schedule.buckets] == BUCKETS6
    per_bucket = {b: [] for b in max_lens}
    for batch in schedule.batches:
        per_bucket[batch.bucket].append(batch)
        limit = 16384 // max_lens[batch.bucket]
        assert 1 <= len(batch.samples) <= limit
        assert len(batch.samples) * max_lens[batch.bucket] <= 16384
        for s in batch.samples:   # every sample sits in its own bucket
            assert lengths6[s] <= max_lens[batch.bucket]
            assert batch.bucket == 0 or lengths6[s] > max_lens[batch.bucket - 1]
    for bucket in schedule.buckets:
        batches = per_bucket[bucket.id]
        assert bucket.batch_size == 16384 // bucket.max_len
        assert bucket.num_batches == len(batches)
        assert bucket.num_samples == sum(len(b.samples) for b in batches)
        short = [b for b in batches if len(b.samples) < bucket.batch_size]
        assert len(short) <= 1   # only one batch of a bucket (its last) may be short
        if short:
            assert len(short[0].samples) == bucket.num_samples % bucket.batch_size
    kept = [s for batch in schedule.batches for s in batch.samples]
    assert len(kept) == len(set(kept)) == len(lengths6)   # nothing dropped, nothing twice
    assert schedule.num_dropped == 0


def test_only_one_short_batch_per_bucket():
    lengths = [10] * 7 + [50] * 5 + [60] * 9
    schedule = build(lengths, buckets=[16, 64], tokens=64, batching="fixed")   # batch sizes 4 and 1
    sizes = {0: [], 1: []}
    for batch in schedule.batches:
        sizes[batch.bucket].append(len(batch.samples))
    assert sorted(sizes[0]) == [3, 4] and sizes[1] == [1] * 14
    schedule = build(lengths, buckets=[16, 64], tokens=128, batching="fixed")  # batch sizes 8 and 2
    sizes = Counter((batch.bucket, len(batch.samples)) for batch in schedule.batches)
    assert sizes == {(0, 7): 1, (1, 2): 7}


def size_class(length, max_seqs, tokens=16384):
    return min(tokens // length, max_seqs)


def test_sorted_batches_fill_the_budget_padded_to_their_longest(lengths6):
    schedule = build(lengths6)
    max_seqs = 16384 // BUCKETS6[0]
    by_bucket = {b.id: [] for b in schedule.buckets}
    for batch in schedule.batches:
        batch_lengths = sorted(lengths6[s] for s in batch.samples)
        assert 1 <= len(batch_lengths) <= max_seqs and len(batch_lengths) * batch_lengths[-1] <= 16384
        assert all(assign_buckets(batch_lengths, BUCKETS6)[i] == batch.bucket for i in range(len(batch_lengths)))
        by_bucket[batch.bucket].append(batch_lengths)
    kept = [s for batch in schedule.batches for s in batch.samples]
    assert sorted(kept) == list(range(len(lengths6)))
    for bucket, batches in by_bucket.items():
        # Greedy over the samples in size-class order: every batch but one of the bucket is as large as fits.
        assert sum(len(b) != min(16384 // b[-1], max_seqs) for b in batches) <= 1
        # Each batch is a run of the size classes: the next one starts in the class this one ends in, or later.
        classes = [[size_class(n, max_seqs) for n in b] for b in batches]
        chain = sorted(classes, key=lambda c: (min(c), max(c)))
        assert all(min(after) >= max(batch) for batch, after in zip(chain, chain[1:]))
        longest = [b[-1] for b in batches]
        assert longest != sorted(longest, reverse=True)  # dealt out in a random order, not longest first


def test_sorted_batch_count_is_the_same_for_every_seed_and_epoch(lengths6):
    expected = count_batches(lengths6, bucket_max_lens=BUCKETS6, tokens_per_batch=16384, batching="sorted")
    schedules = [build(lengths6, epoch=e, seed=s) for e in (0, 1) for s in (0, 3)]
    assert {schedule.num_jobs for schedule in schedules} == {expected}
    # More than the count: every bucket cuts batches of the same sizes in every epoch.
    assert len({tuple(sorted((b.bucket, len(b.samples)) for b in schedule.batches)) for schedule in schedules}) == 1
    assert count_batches(lengths6, bucket_max_lens=BUCKETS6, tokens_per_batch=16384,
                         batching="fixed") == build(lengths6, batching="fixed").num_jobs
    assert set(build(lengths6, epoch=0).batches) != set(build(lengths6, epoch=1).batches)


def lognormal_mix():
    """The mix ``hsd bench target`` measures by default (median 400, sigma 0.9, capped at 4096)."""
    rng = np.random.default_rng(0)
    return np.clip(np.rint(rng.lognormal(np.log(400), 0.9, 20_000)), 1, 4096).astype(np.int64)


LOGNORMAL_BUCKETS = [128, 256, 512, 1024, 2048, 4096]


def test_sorted_batching_fills_slots_on_a_lognormal_mix_and_stays_fair():
    lengths = lognormal_mix()
    fill = {}
    for batching in ("fixed", "sorted"):
        schedule = build(lengths, buckets=LOGNORMAL_BUCKETS, tokens=8192, batching=batching)
        fill[batching] = lengths[schedule.job_samples].sum() / (schedule.num_jobs * 8192)
        figures = schedule.figures()
        assert figures["prefix_deviation"] <= 2 and figures["tail_skew"] <= 0.03
    assert fill["fixed"] < 0.75 and fill["sorted"] >= 0.92


def test_sorted_batches_change_members_every_epoch_at_nearly_no_padding():
    lengths = lognormal_mix()
    epochs = [build(lengths, buckets=LOGNORMAL_BUCKETS, tokens=8192, epoch=e, seed=4) for e in range(3)]
    for schedule in epochs:
        for batch in schedule.batches:
            assert len(batch.samples) * lengths[list(batch.samples)].max() <= 8192
        # Padding is what an exact length sort leaves (0.999 real) plus the jitter's share.
        padded = sum(len(b.samples) * lengths[list(b.samples)].max() for b in schedule.batches)
        assert schedule.padded_fill(lengths) == pytest.approx(lengths.sum() / padded)
        assert schedule.padded_fill(lengths) >= 0.985
    # An exact length sort keeps 0.61 of the pairs together from one epoch to the next, most of them in
    # every bucket; here it is 0.28, and under 0.1 where batches hold at most 31 sequences.
    for first, second in zip(epochs, epochs[1:]):
        assert pairs_batched_again(first, second) <= 0.35
        for bucket, max_len in enumerate(LOGNORMAL_BUCKETS):
            if max_len >= 512:
                assert pairs_batched_again(*(only_bucket(s, bucket) for s in (first, second))) <= 0.12


def only_bucket(schedule, bucket):
    """The schedule's jobs of one bucket, in their order."""
    jobs = np.flatnonzero(schedule.job_bucket == bucket)
    samples = [schedule.job_samples[schedule.job_offsets[j]:schedule.job_offsets[j + 1]] for j in jobs]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])])
    return EpochSchedule(epoch=schedule.epoch, seed=schedule.seed, order_kind=schedule.order_kind,
                         tokens_per_batch=schedule.tokens_per_batch, buckets=schedule.buckets, num_dropped=0,
                         job_bucket=schedule.job_bucket[jobs], job_offsets=offsets, job_samples=np.concatenate(samples),
                         batching=schedule.batching)


def test_pairs_batched_again_counts_the_pairs_that_meet_again():
    def schedule(*batches):
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in batches])])
        return EpochSchedule(epoch=0, seed=0, order_kind="interleave", tokens_per_batch=8, buckets=(), num_dropped=0,
                             job_bucket=np.zeros(len(batches), dtype=np.int16), job_offsets=offsets,
                             job_samples=np.asarray([s for b in batches for s in b], dtype=np.int64), batching="sorted")
    first = schedule([0, 1, 2], [3, 4], [5])  # pairs 01 02 12 34
    assert pairs_batched_again(first, first) == 1.0
    assert pairs_batched_again(first, schedule([5, 2, 1], [0, 3], [4])) == 0.25    # 12
    assert pairs_batched_again(first, schedule([4, 3], [1], [2, 0, 5])) == 0.5     # 34 02
    assert pairs_batched_again(schedule([0], [1]), schedule([0, 1])) == 0.0        # no pairs at all


def test_job_list_bucket_order_matches_batches(lengths6):
    schedule = build(lengths6)
    assert schedule.bucket_order == [b.bucket for b in schedule.batches]
    totals = Counter(schedule.bucket_order)
    assert {b.id: b.num_batches for b in schedule.buckets if b.num_batches} == dict(totals)


# -- determinism ----------------------------------------------------------------------------------

def test_same_seed_and_epoch_gives_identical_schedule(lengths6):
    assert build(lengths6, epoch=2, seed=5).batches == build(lengths6, epoch=2, seed=5).batches
    assert (build(lengths6, order="shuffle", epoch=1, seed=5).batches
            == build(lengths6, order="shuffle", epoch=1, seed=5).batches)


def test_other_epoch_or_seed_gives_another_order(lengths6):
    base = build(lengths6, epoch=0, seed=5)
    other_epoch = build(lengths6, epoch=1, seed=5)
    other_seed = build(lengths6, epoch=0, seed=6)
    assert base.seed == epoch_seed(5, 0) != other_epoch.seed
    for other in (other_epoch, other_seed):
        assert other.batches != base.batches
        # a different grouping of samples, not just a different bucket sequence
        assert {b.samples for b in other.batches} != {b.samples for b in base.batches}
        # same bucket sizes though: same data
        assert [b.num_batches for b in other.buckets] == [b.num_batches for b in base.buckets]


def test_epoch_seed_depends_on_both():
    seeds = {epoch_seed(r, e) for r in range(3) for e in range(3)}
    assert len(seeds) == 9


def test_unknown_order_rejected(lengths6):
    with pytest.raises(ValueError, match="round_robin"):
        build(lengths6[:10], order="round_robin")


# -- fairness -------------------------------------------------------------------------------------

@pytest.mark.parametrize("epoch", [0, 1, 2, 3])
def test_interleave_is_fair_on_every_prefix(lengths6, epoch):
    interleave = build(lengths6, epoch=epoch, seed=1)
    shuffle = build(lengths6, epoch=epoch, seed=1, order="shuffle")
    order = interleave.bucket_order
    assert len(order) > 1000 and len(set(order)) == 6
    assert prefix_deviation(order) <= 2.0
    assert tail_skew(order) <= 0.05
    assert interleave.figures() == pytest.approx({"prefix_deviation": prefix_deviation(order), "tail_skew": tail_skew(order)})
    assert prefix_deviation(shuffle.bucket_order) > prefix_deviation(order) + 2.0
    # the same jobs, only ordered differently
    assert Counter(shuffle.bucket_order) == Counter(order)


def test_interleave_first_hundred_jobs_are_not_front_loaded(lengths6):
    schedule = build(lengths6, epoch=0, seed=0)
    order = schedule.bucket_order
    totals = Counter(order)
    first = Counter(order[:100])
    for b, n in totals.items():
        assert abs(first[b] - 100 * n / len(order)) <= 2.0
    # the rare buckets are not used up before the tail
    last = Counter(order[-len(order) // 10:])
    assert all(last[b] >= 1 for b, n in totals.items() if n >= 20)


def test_interleave_order_counts_and_prefix():
    counts = [3, 0, 10, 1, 30]
    order = interleave_order(counts, np.random.default_rng(0)).tolist()
    assert Counter(order) == {0: 3, 2: 10, 3: 1, 4: 30}
    assert prefix_deviation(order) <= 2.0
    assert interleave_order([], np.random.default_rng(0)).tolist() == []


def test_a_million_jobs_stay_within_one_and_a_half_batches():
    counts = [20_000, 35_000, 50_000, 75_000, 85_000, 737_532]
    order = interleave_order(counts, np.random.default_rng(7))
    assert len(order) == sum(counts)
    assert prefix_deviation_array(order) <= 1.5


# -- persistence ----------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path, lengths6):
    schedule = build(lengths6[:2000], epoch=3, seed=2)
    path = save_schedule(schedule, tmp_path)
    assert path == schedule_path(tmp_path, 3) and path.is_dir()
    assert not list(path.parent.glob("*.tmp"))
    loaded = load_schedule(tmp_path, 3)
    assert loaded.batches == schedule.batches and loaded.buckets == schedule.buckets
    assert loaded.bucket_order == schedule.bucket_order
    assert loaded.saved_figures == schedule.figures()
    json.loads((path / "meta.json").read_text())   # plain JSON beside the arrays
    assert load_schedule(tmp_path, 4) is None


def test_summary_shape(lengths6):
    schedule = build(lengths6[:500])
    summary = schedule.summary()
    assert summary["num_jobs"] == len(schedule.batches)
    assert summary["order"] == schedule.bucket_order
    assert len(summary["buckets"]) == 6
    json.dumps(summary)


def test_a_schedule_written_before_batching_and_figures_were_recorded_loads_as_fixed(tmp_path, lengths6):
    schedule = build(lengths6[:500], epoch=2, batching="fixed")
    path = save_schedule(schedule, tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    assert list(meta) == ["epoch", "seed", "order_kind", "batching", "tokens_per_batch", "num_dropped", "num_jobs",
                          "buckets", "figures"]  # the layout the untyped writer wrote
    assert meta["buckets"][0] == {"id": 0, "max_len": schedule.buckets[0].max_len,
                                  "batch_size": schedule.buckets[0].batch_size,
                                  "num_batches": schedule.buckets[0].num_batches,
                                  "num_samples": schedule.buckets[0].num_samples}
    del meta["batching"], meta["figures"]
    (path / "meta.json").write_text(json.dumps(meta))
    loaded = load_schedule(tmp_path, 2)
    assert loaded.batching == "fixed" and loaded.saved_figures is None
    assert loaded.batches == schedule.batches and loaded.buckets == schedule.buckets
