"""dispatcher/pool.py: slot accounting, credits, min-ready reservoir, pull policy."""

import random
from collections import Counter

import pytest

from common.run.records.fairness import prefix_deviation, tail_skew
from common.run.records.schedule import build_epoch_schedule
from dispatcher.pool import HSPool, SlotState, choose_bucket, eligible_buckets


def make_pool(num_slots=8, *, min_ready=1, credits=100, pull="deficit", seed=0):
    pool = HSPool(min_ready=min_ready, target_credits=credits, pull=pull, seed=seed)
    pool.add_slots(range(num_slots))
    return pool


def publish(pool, job_id, bucket, epoch=0, target="t0"):
    slot = pool.writable_slot(target)
    assert slot is not None
    pool.begin_write(slot, target, job_id)
    pool.publish(slot, epoch=epoch, bucket=bucket)
    return slot


def pick(pool, epoch, totals, taken, window=frozenset()):
    eligible = pool.eligible(epoch, totals=totals, taken=taken)
    return pool.pick(epoch, eligible=eligible, window=set(window))


def nonzero(per_bucket):
    return {b: n for b, n in per_bucket.items() if n}


def take(pool, ready):
    pool.begin_read(ready)
    pool.release(ready.slot)


def test_unknown_pull_policy():
    with pytest.raises(ValueError, match="greedy"):
        HSPool(min_ready=1, target_credits=1, pull="greedy")


def test_duplicate_slot_rejected():
    pool = make_pool(2)
    with pytest.raises(ValueError):
        pool.add_slots([1])


# -- targets: credits and free slots --------------------------------------------------------------

def test_credits_bound_the_slots_a_target_writes():
    pool = make_pool(6, credits=2)
    writing = []
    for job_id in range(2):
        slot = pool.writable_slot("t0")
        assert slot is not None and slot not in writing
        pool.begin_write(slot, "t0", job_id)
        writing.append(slot)
    assert pool.writable_slot("t0") is None
    assert pool.blocked_reason("t0") == "credits"
    assert pool.counts()["writing"] == 2
    # another target has its own credits
    t1 = pool.writable_slot("t1")
    assert t1 is not None and t1 not in writing
    # publishing gives the credit back
    pool.publish(writing[0], epoch=0, bucket=0)
    assert pool.writable_slot("t0") is not None
    # aborting does too, and frees the slot
    pool.abort_write(writing[1])
    assert pool.slots[writing[1]].state is SlotState.FREE and pool.slots[writing[1]].job_id is None
    for job_id in range(2, 4):
        slot = pool.writable_slot("t0")
        pool.begin_write(slot, "t0", job_id)
    assert pool.writable_slot("t0") is None
    assert sum(1 for s in pool.slots.values() if s.writer == "t0") == 2


def test_no_free_slot():
    pool = make_pool(2, credits=5)
    publish(pool, 0, 0)
    publish(pool, 1, 0)
    assert pool.writable_slot("t0") is None and pool.writable_slot("t1") is None
    assert pool.blocked_reason("t0") == "no_free_slot"
    assert pool.counts() == {"free": 0, "writing": 0, "ready": 2, "reading": 0, "quarantined": 0}


def test_generation_increments_on_every_write():
    pool = make_pool(1)
    generations = []
    for job_id in range(3):
        generations.append(pool.begin_write(0, "t0", job_id))
        assert pool.slots[0].generation == generations[-1]
        if job_id == 1:
            pool.abort_write(0)
            continue
        pool.publish(0, epoch=0, bucket=0)
        (ready,) = [pick(pool, 0, {0: 3}, Counter())]
        assert ready.job_id == job_id
        take(pool, ready)
    assert generations == [1, 2, 3]
    assert pool.slots[0].state is SlotState.FREE


def test_abort_or_release_of_a_vanished_slot_is_a_no_op():
    pool = make_pool(1)
    pool.abort_write(42)
    pool.release(42)
    assert pool.counts()["free"] == 1


# -- drafters: reservoir ---------------------------------------------------------------------------

def test_may_serve_honours_min_ready_except_when_draining():
    pool = make_pool(8, min_ready=3)
    assert not pool.may_serve(draining=False) and not pool.may_serve(draining=True)   # nothing to serve
    publish(pool, 0, 0)
    publish(pool, 1, 1)
    assert pool.num_ready == 2
    assert not pool.may_serve(draining=False)
    assert pool.may_serve(draining=True)
    publish(pool, 2, 0)
    assert pool.may_serve(draining=False)
    take(pool, pick(pool, 0, {0: 2, 1: 1}, Counter()))
    assert pool.num_ready == 2 and not pool.may_serve(draining=False)


def test_has_ready_per_epoch_and_ready_per_bucket():
    pool = make_pool(8)
    assert not pool.has_ready(0)
    publish(pool, 10, 2, epoch=0)
    publish(pool, 11, 2, epoch=0)
    publish(pool, 20, 0, epoch=1)
    assert pool.has_ready(0) and pool.has_ready(1) and not pool.has_ready(2)
    assert nonzero(pool.ready_per_bucket()) == {0: 1, 2: 2}
    take(pool, pick(pool, 1, {0: 1}, Counter()))
    assert not pool.has_ready(1) and nonzero(pool.ready_per_bucket()) == {2: 2}


# -- pull policy ----------------------------------------------------------------------------------

def test_choose_bucket_largest_deficit_fresh_first():
    rng = random.Random(0)
    deficits = {0: 0.5, 1: 2.0, 2: 1.0}
    assert choose_bucket(deficits, window=set(), rng=rng) == 1
    assert choose_bucket(deficits, window={1}, rng=rng) == 2
    assert choose_bucket(deficits, window={1, 2}, rng=rng) == 0
    assert choose_bucket(deficits, window={0, 1, 2}, rng=rng) == 1   # all used: largest deficit again
    picks = {choose_bucket({0: 1.0, 1: 1.0, 2: 0.0}, window=set(), rng=rng) for _ in range(50)}
    assert picks == {0, 1}    # exact ties are broken at random, never toward a lower deficit


def test_eligible_buckets_deficits():
    totals = {0: 10, 1: 10, 2: 20}
    # 7 taken; position 8: expected 2, 2, 4 -> deficits 1, -1, 1
    taken = Counter({0: 1, 1: 3, 2: 3})
    eligible = eligible_buckets([0, 1, 2], totals=totals, taken=taken)
    assert set(eligible) == {0, 2}        # bucket 1 already runs a batch ahead of its share
    assert eligible[0] == pytest.approx(1.0) and eligible[2] == pytest.approx(1.0)
    # every ready bucket ahead: only the least-ahead one is offered
    assert set(eligible_buckets([1], totals=totals, taken=taken)) == {1}
    # a bucket lagging by 1.5 batches or more is offered alone
    taken = Counter({0: 0, 1: 3, 2: 3})   # position 7: deficits 1.75, -1.25, 0.5
    assert set(eligible_buckets([0, 1, 2], totals=totals, taken=taken)) == {0}
    assert eligible_buckets([], totals=totals, taken=taken) == {}


def test_lagging_bucket_is_served_even_inside_the_window():
    pool = make_pool(8)
    for job_id, bucket in enumerate([0, 1, 2]):
        publish(pool, job_id, bucket)
    totals = {0: 10, 1: 10, 2: 20}
    taken = Counter({0: 0, 1: 3, 2: 3})   # bucket 0 lags by 1.75 batches
    assert pick(pool, 0, totals, taken, window={0}).bucket == 0
    taken = Counter({0: 1, 1: 3, 2: 3})   # lags by 1 only: the window decides
    assert pick(pool, 0, totals, taken, window={0}).bucket == 2


def test_pick_chooses_largest_deficit_then_prefers_fresh_buckets():
    pool = make_pool(8)
    for job_id, bucket in enumerate([0, 0, 1, 2, 2]):
        publish(pool, job_id, bucket)
    totals = {0: 10, 1: 10, 2: 10}
    taken = Counter({0: 3, 1: 1, 2: 2})      # position 7: deficits -2/3, 4/3, 1/3
    assert pick(pool, 0, totals, taken).bucket == 1
    assert pick(pool, 0, totals, taken, window={1}).bucket == 2
    assert pick(pool, 0, totals, taken, window={1, 2}).bucket == 0
    ready = pick(pool, 0, totals, taken)
    assert ready.job_id == 2 and ready.slot == pool.slots[ready.slot].id
    assert pool.slots[ready.slot].job_id == 2


def test_pick_is_random_within_a_bucket():
    seen = set()
    for seed in range(20):
        pool = make_pool(8, seed=seed)
        for job_id in range(4):
            publish(pool, job_id, 0)
        seen.add(pick(pool, 0, {0: 4}, Counter()).job_id)
    assert len(seen) >= 3


def test_deficit_pull_mixes_a_dominated_pool():
    """The pool of problem 4: [1, 1, 1, 3, 2, 12] items per bucket. Deficit picks spread, random does not."""
    composition = [1, 1, 1, 3, 2, 12]
    totals = {b: 100 for b in range(6)}   # an epoch with equal shares
    distinct = {"deficit": [], "random": []}
    for pull in distinct:
        for seed in range(30):
            pool = make_pool(20, pull=pull, seed=seed)
            job_id = 0
            for bucket, n in enumerate(composition):
                for _ in range(n):
                    publish(pool, job_id, bucket)
                    job_id += 1
            taken, window = Counter(), set()
            for _ in range(6):
                ready = pick(pool, 0, totals, taken, window)
                take(pool, ready)
                taken[ready.bucket] += 1
                window.add(ready.bucket)
            distinct[pull].append(len(window))
    assert all(n == 6 for n in distinct["deficit"])
    assert sum(distinct["random"]) / 30 < 4.0


def simulate(pull, seed, *, slots=16, min_ready=6, accum=4):
    """Targets fill every free slot in schedule order; one drafter picks and releases, window of ``accum``."""
    lengths, rng = [], random.Random(seed)
    shares = (0.04, 0.07, 0.10, 0.15, 0.17, 0.47)
    buckets = [256, 512, 1024, 2048, 4096, 8192]
    lower = 0
    for max_len, share in zip(buckets, shares):
        lengths += [rng.randint(lower + 1, max_len) for _ in range(round(6000 * share))]
        lower = max_len
    schedule = build_epoch_schedule(lengths, bucket_max_lens=buckets, tokens_per_batch=16384, run_seed=seed,
                                    epoch=0, order="interleave")
    order = schedule.bucket_order
    totals = dict(Counter(order))
    pool = make_pool(slots, min_ready=min_ready, pull=pull, seed=seed)
    next_job, taken, consumed, window = 0, Counter(), [], set()
    while len(consumed) < len(order):
        while next_job < len(order) and pool.writable_slot("t0") is not None:
            publish(pool, next_job, order[next_job])
            next_job += 1
        assert pool.may_serve(draining=next_job == len(order))
        ready = pick(pool, 0, totals, taken, window)
        take(pool, ready)
        taken[ready.bucket] += 1
        consumed.append(ready.bucket)
        window.add(ready.bucket)
        if len(consumed) % accum == 0:
            window = set()
    assert Counter(consumed) == Counter(order)
    return prefix_deviation(consumed, totals), tail_skew(consumed, totals)


def test_long_run_deficit_keeps_consumed_stream_proportional_random_does_not():
    deficit = [simulate("deficit", seed) for seed in range(3)]
    random_ = [simulate("random", seed) for seed in range(3)]
    for deviation, skew in deficit:
        assert deviation <= 3.0
        assert skew <= 0.05
    mean_deficit = sum(d for d, _ in deficit) / 3
    mean_random = sum(d for d, _ in random_) / 3
    assert mean_random >= 2 * mean_deficit
    assert max(d for d, _ in random_) > 3.0


# -- owners ---------------------------------------------------------------------------------------

def test_owner_slots_are_writable_only_by_their_owner():
    pool = HSPool(min_ready=1, target_credits=5)
    pool.add_slots([0, 1], owner="t0")
    pool.add_slots([2])                       # shared
    assert pool.writable_slot("t1") == 2
    assert pool.writable_slot("t0") in (0, 1)  # its own memory first
    pool.begin_write(2, "t1", 100)
    assert pool.writable_slot("t1") is None   # t0's slots are free but not t1's to write
    assert pool.blocked_reason("t1") == "no_free_slot"
    own = []
    for job_id in range(2):
        slot = pool.writable_slot("t0")
        assert slot in (0, 1)
        pool.begin_write(slot, "t0", job_id)
        own.append(slot)
    assert sorted(own) == [0, 1]
    assert pool.writable_slot("t0") is None
    pool.abort_write(2)
    assert pool.writable_slot("t0") == 2      # shared slots are anyone's


def test_remove_owner_returns_slots_holding_jobs():
    pool = HSPool(min_ready=1, target_credits=5)
    pool.add_slots([0, 1, 2, 3], owner="t0")
    pool.add_slots([4], owner="t1")
    pool.add_slots([5])
    pool.begin_write(0, "t0", 10)
    pool.publish(0, epoch=0, bucket=1)        # ready
    pool.begin_write(1, "t0", 11)             # writing
    pool.begin_write(2, "t0", 12)
    pool.publish(2, epoch=0, bucket=2)
    ready = pick(pool, 0, {1: 1, 2: 1}, Counter(), window={1})
    assert ready.job_id == 12
    pool.begin_read(ready)                    # reading; slot 3 stays free
    publish(pool, 13, 1, target="t1")         # in t1's own slot 4
    assert pool.num_ready == 2
    lost = pool.remove_owner("t0")
    assert sorted((s.id, s.job_id) for s in lost) == [(0, 10), (1, 11), (2, 12)]
    assert set(pool.slots) == {4, 5}
    assert pool.num_ready == 1 and nonzero(pool.ready_per_bucket()) == {1: 1}
    assert pick(pool, 0, {1: 1, 2: 1}, Counter()).job_id == 13
    assert pool.remove_owner("t0") == []
    assert pool.writable_slot("t0") == 5


def test_unread_puts_a_slot_back_to_ready():
    pool = make_pool(4, min_ready=2)
    publish(pool, 0, 0)
    publish(pool, 1, 1)
    ready = pick(pool, 0, {0: 1, 1: 1}, Counter(), window={1})
    assert ready.job_id == 0
    pool.begin_read(ready)
    assert pool.num_ready == 1 and pool.slots[ready.slot].state is SlotState.READING
    assert not pool.may_serve(draining=False)
    pool.unread(ready.slot, epoch=0, bucket=0)
    assert pool.slots[ready.slot].state is SlotState.READY and pool.num_ready == 2
    assert pool.may_serve(draining=False)
    assert nonzero(pool.ready_per_bucket()) == {0: 1, 1: 1}
    again = pick(pool, 0, {0: 1, 1: 1}, Counter(), window={1})
    assert again == ready


def test_min_ready_is_capped_by_the_slots_that_exist():
    pool = make_pool(5, min_ready=8)
    for slot in range(3):
        publish(pool, slot, slot)
    assert not pool.may_serve(draining=False)
    publish(pool, 3, 0)
    assert pool.effective_min_ready == 4 and pool.may_serve(draining=False)


def test_a_quarantined_slot_is_reused_only_once_its_writer_is_gone():
    pool = make_pool(1, credits=1)
    slot = pool.writable_slot("t0")
    pool.begin_write(slot, "t0", job_id=7)
    pool.quarantine(slot)
    assert pool.writable_slot("t1") is None and pool.counts()["quarantined"] == 1
    assert pool.release_quarantined("t1") == 0
    assert pool.release_quarantined("t0") == 1
    assert pool.writable_slot("t1") == slot and pool.writable_slot("t0") == slot


def test_the_one_node_pick_draws_what_the_general_pick_draws():
    """With every ready slot in the dispatcher's arena, pick takes a shortcut past the per-slot node
    filters: it must choose the same job, drawing the same random numbers, as the general path (taken
    here because another epoch has a ready slot on a node). Job ids come in no order, and a slot
    whose reader died is put back, so the shortcut's ordered ids are checked against sorting."""
    rng = random.Random(3)
    shortcut, general = make_pool(12, seed=7), HSPool(min_ready=1, target_credits=100, pull="deficit", seed=7)
    general.add_slots(range(12))
    general.add_slots([99], owner="far-target", node="far")
    general.begin_write(99, "far-target", 10**9)
    general.publish(99, epoch=5, bucket=0)  # not the epoch picked from: it only turns the shortcut off
    totals, taken = {0: 40, 1: 25, 2: 20, 3: 15}, Counter()
    job_ids = iter(rng.sample(range(10**9), 2000))
    for _ in range(300):
        while shortcut.writable_slot("t0") is not None and rng.random() < 0.7:
            bucket, job_id = rng.choice(list(totals)), next(job_ids)
            assert publish(shortcut, job_id, bucket) == publish(general, job_id, bucket)
        window = set(rng.sample(list(totals), rng.randint(0, 3)))
        eligible = shortcut.eligible(0, totals=totals, taken=taken)
        assert eligible == general.eligible(0, totals=totals, taken=taken)
        a = shortcut.pick(0, eligible=eligible, window=window)
        b = general.pick(0, eligible=eligible, window=window, servable={None, "far"})
        assert (a and (a.job_id, a.slot)) == (b and (b.job_id, b.slot))
        if a is not None and rng.random() < 0.2:  # its reader died before the copy: ready again
            for pool, ready in ((shortcut, a), (general, b)):
                pool.begin_read(ready)
                pool.unread(ready.slot, epoch=ready.epoch, bucket=ready.bucket)
        elif a is not None:
            take(shortcut, a)
            take(general, b)
            taken[a.bucket] += 1
    assert shortcut.rng.random() == general.rng.random()
    assert sum(taken.values()) > 150
