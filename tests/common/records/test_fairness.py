"""common/run/records/fairness.py: prefix deviation and tail skew on hand-computed sequences."""

import pytest

from common.run.records.fairness import bucket_totals, prefix_deviation, tail_skew


@pytest.mark.parametrize("order, expected", [
    ([0, 0, 1, 1], 1.0),
    ([0, 1, 0, 1], 0.5),
    ([0, 1] * 50, 0.5),
    ([0] * 5 + [1] * 5, 2.5),
    ([0, 0, 0], 0.0),                 # one bucket is always proportional
    ([], 0.0),
    # totals 3:1 -> shares .75/.25; worst is after "1" at t=1: |1 - .25| = .75
    ([1, 0, 0, 0], 0.75),
    ([0, 0, 0, 1], 0.75),             # t=3: |3 - 2.25| = .75
    ([0, 1, 0, 0], 0.5),              # t=1: |1-.75|=.25, t=2: |1-1.5|=.5 (and bucket 1 |1-.5|=.5)
    ([0, 1, 2, 0, 1, 2], 2 / 3),      # t=1: bucket 0 |1 - 1/3| = 2/3
])
def test_prefix_deviation_hand_computed(order, expected):
    assert prefix_deviation(order) == pytest.approx(expected)


def test_prefix_deviation_of_partial_stream_against_epoch_totals():
    totals = {0: 2, 1: 2}
    # on its own a stream of one bucket is "proportional"; against the epoch it lags bucket 1 by 1
    assert prefix_deviation([0, 0]) == 0.0
    assert prefix_deviation([0, 0], totals) == pytest.approx(1.0)
    assert prefix_deviation([0, 1], totals) == pytest.approx(0.5)
    # 4 of 8 jobs consumed, all of bucket 0: |4 - 4 * 6/8| = 1 and |0 - 4 * 2/8| = 1
    assert prefix_deviation([0, 0, 0, 0], {0: 6, 1: 2}) == pytest.approx(1.0)


def test_prefix_deviation_counts_unknown_bucket_fully():
    # bucket 9 is not in the totals: its every job counts as deviation
    assert prefix_deviation([0, 9, 9], {0: 3}) >= 2.0


def test_prefix_deviation_grows_with_front_loading():
    balanced = [0, 0, 1] * 20
    front = [0] * 40 + [1] * 20
    assert prefix_deviation(balanced) < 1.0
    assert prefix_deviation(front) == pytest.approx(40 - 40 * 40 / 60)


def test_tail_skew_hand_computed():
    # whole epoch: 90% bucket 0, 10% bucket 1; the last 10% (one job) is all bucket 1
    assert tail_skew([0] * 9 + [1]) == pytest.approx(0.9)
    # last job matches the dominant bucket: TV = .5 * (|1 - .9| + |0 - .1|) = .1
    assert tail_skew([1] + [0] * 9) == pytest.approx(0.1)
    # a tail that mirrors the epoch exactly
    assert tail_skew([0, 1] * 10) == pytest.approx(0.0)
    assert tail_skew([]) == 0.0


def test_tail_skew_of_starved_tail():
    # 100 jobs, the rare bucket is used up before the last 10: tail is all bucket 0
    order = [0, 1] * 20 + [0] * 60
    # epoch shares: 0 -> .8, 1 -> .2; tail: 0 -> 1.0 => TV = .2
    assert tail_skew(order) == pytest.approx(0.2)


def test_tail_skew_of_partial_stream_against_epoch_totals():
    totals = {0: 5, 1: 5}
    # 10 consumed so far, last one (10%) is bucket 0; against the epoch's 50/50 mix: TV = .5
    assert tail_skew([0, 1] * 4 + [1, 0], totals) == pytest.approx(0.5)
    # a bucket the totals do not know counts fully
    assert tail_skew([7] * 10, {0: 10}) == pytest.approx(1.0)


def test_tail_skew_fraction():
    order = [0] * 8 + [1, 1]
    assert tail_skew(order, tail_fraction=0.2) == pytest.approx(0.8)   # tail all 1s vs share .2
    assert tail_skew(order, tail_fraction=1.0) == pytest.approx(0.0)


def test_bucket_totals():
    assert bucket_totals([2, 0, 2, 2]) == {2: 3, 0: 1}


def test_incremental_tracker_equals_the_full_pass():
    import random
    rng = random.Random(5)
    totals = {0: 30, 1: 50, 2: 20}
    order = [b for b, n in totals.items() for _ in range(n)]
    rng.shuffle(order)
    from common.run.records.fairness import PrefixDeviation
    tracker = PrefixDeviation(totals)
    for t, bucket in enumerate(order, start=1):
        tracker.add(bucket)
        assert tracker.value == prefix_deviation(order[:t], totals)


def test_add_many_matches_adding_one_at_a_time():
    import random
    from common.run.records.fairness import PrefixDeviation
    rng = random.Random(5)
    totals = {0: 40, 1: 25, 2: 7}
    for _ in range(50):
        runs = [(rng.choice([0, 1, 2, 3]), rng.randint(0, 9)) for _ in range(rng.randint(1, 6))]
        one, many = PrefixDeviation(totals), PrefixDeviation(totals)
        for bucket, count in runs:
            for _ in range(count):
                one.add(bucket)
            many.add_many(bucket, count)
        assert many.length == one.length and many.counts == one.counts
        assert abs(many.value - one.value) < 1e-9


class _EveryBucketEveryJob:
    """The figure the plain way, as its definition reads: every bucket measured after every job."""

    def __init__(self, totals: dict[int, int]):
        num_jobs = sum(totals.values())
        self.shares = {b: n / num_jobs for b, n in totals.items()}
        self.counts: dict[int, int] = {}
        self.length = 0
        self.value = 0.0

    def measure(self) -> None:
        for b, count in self.counts.items():
            if b not in self.shares:
                self.value = max(self.value, count)
        for b, share in self.shares.items():
            self.value = max(self.value, abs(self.counts.get(b, 0) - self.length * share))

    def add(self, bucket: int) -> None:
        self.length += 1
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        self.measure()

    def remove(self, bucket: int) -> None:
        self.length -= 1
        self.counts[bucket] -= 1


def test_tracker_equals_measuring_every_bucket_after_every_job_through_give_backs():
    """The tracker settles each bucket's extremes as its jobs come instead of measuring every bucket
    every time: the same figure exactly, give-backs (which break the extremes' order) and runs included."""
    import random
    from common.run.records.fairness import PrefixDeviation
    rng = random.Random(11)
    for trial in range(300):
        totals = {b: rng.randint(1, 60) for b in range(rng.randint(1, 6))}
        tracker, reference = PrefixDeviation(totals), _EveryBucketEveryJob(totals)
        for _ in range(rng.randint(1, 120)):
            bucket = rng.choice([*totals, len(totals)])  # now and then a bucket the totals do not know
            roll = rng.random()
            if roll < 0.2 and reference.counts.get(bucket, 0) > 0:
                tracker.remove(bucket)
                reference.remove(bucket)
            elif roll < 0.35:
                count = rng.randint(0, 5)
                tracker.add_many(bucket, count)
                if count:
                    reference.add(bucket)  # a run is measured at its first and last job, as its jobs one by one
                    reference.length += count - 1
                    reference.counts[bucket] += count - 1
                    reference.measure()
            else:
                tracker.add(bucket)
                reference.add(bucket)
            assert tracker.value == reference.value, trial
            assert tracker.length == reference.length
