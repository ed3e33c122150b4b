"""dispatcher/ledger.py: job states, transitions, give-backs, leases, epoch progress."""

from collections import Counter

import pytest

from dispatcher.ledger import JobLedger, JobState, LedgerError, make_job_id, split_job_id

P, X, R, T, C, K = (JobState.PENDING, JobState.EXTRACTING, JobState.READY, JobState.TRAINING, JobState.CONSUMED,
                    JobState.COMMITTED)


def batches(buckets):
    """(bucket, seq_len, samples, num_tokens) per job, in job order."""
    return [(b, 64 * (b + 1), (10 * i, 10 * i + 1), 100 + i) for i, b in enumerate(buckets)]


def ledger_with(buckets, epoch=0, committed=()):
    ledger = JobLedger()
    ledger.add_epoch(epoch, batches(buckets), committed=committed)
    check_counts(ledger)
    return ledger


def check_counts(ledger):
    """count() and counts_by_state() agree with the jobs' own states."""
    actual = Counter((job.epoch, job.state) for job in ledger.jobs.values())
    for epoch in ledger.epochs:
        for state in JobState:
            assert ledger.count(epoch, state) == actual[epoch, state], (epoch, state)
    by_state = ledger.counts_by_state()
    assert by_state == {s.value: sum(actual[e, s] for e in ledger.epochs) for s in JobState}
    assert sum(by_state.values()) == len(ledger.jobs)
    assert ledger.num_pending == by_state["pending"]
    for epoch, progress in ledger.epochs.items():
        assert progress.committed == actual[epoch, K]
        assert sum(progress.taken.values()) == len(progress.consumed_order)
        assert Counter(progress.consumed_order) == +progress.taken
        assert sum(progress.taken.values()) == sum(actual[epoch, s] for s in (T, C, K))


def to_ready(ledger, target="t0", slot=0, now=0.0):
    job = ledger.start_extract(target, slot, 1, now, 10.0)
    ledger.mark_ready(job.job_id, target, 1)
    return job


def to_consumed(ledger, drafter="d0", target="t0", slot=0):
    job = to_ready(ledger, target, slot)
    ledger.start_training(job.job_id, drafter, 0.0, 10.0)
    ledger.mark_consumed(job.job_id, drafter)
    return job


def test_job_ids():
    assert split_job_id(make_job_id(3, 17)) == (3, 17)
    assert make_job_id(1, 0) > make_job_id(0, 999_999)


def test_full_path():
    ledger = ledger_with([2, 0, 1])
    assert ledger.num_pending == 3 and ledger.peek_pending().job_id == make_job_id(0, 0)
    job = ledger.start_extract("t0", 5, 7, now=1.0, lease_s=10.0)
    assert job.job_id == make_job_id(0, 0) and job.bucket == 2 and job.samples == (0, 1) and job.num_tokens == 100
    assert (job.state, job.holder, job.slot, job.generation, job.lease_deadline) == (X, "t0", 5, 7, 11.0)
    assert ledger.held_by("t0") == [job]
    check_counts(ledger)

    ledger.mark_ready(job.job_id, "t0", 7)
    assert (job.state, job.holder, job.slot) == (R, None, 5)
    assert ledger.held_by("t0") == []
    check_counts(ledger)

    ledger.start_training(job.job_id, "d0", now=2.0, lease_s=10.0)
    assert (job.state, job.holder, job.lease_deadline) == (T, "d0", 12.0)
    assert ledger.epochs[0].taken == Counter({2: 1}) and ledger.epochs[0].consumed_order == [2]
    check_counts(ledger)

    ledger.mark_consumed(job.job_id, "d0")
    assert (job.state, job.holder, job.slot) == (C, "d0", None)
    check_counts(ledger)

    ledger.commit([job.job_id], "d0", step=4)
    assert (job.state, job.holder, job.step) == (K, None, 4)
    assert ledger.epochs[0].committed == 1 and not ledger.epoch_complete(0)
    assert ledger.held_by("d0") == []
    check_counts(ledger)

    rest = [to_consumed(ledger, slot=i) for i in range(2)]
    ledger.commit([j.job_id for j in rest], "d0", step=5)
    assert ledger.epoch_complete(0) and not ledger.epoch_complete(1)
    assert ledger.counts_by_state()["committed"] == 3
    assert ledger.epochs[0].consumed_order == [2, 0, 1]
    check_counts(ledger)


def test_wrong_state_transitions_raise():
    ledger = ledger_with([0, 1, 2, 0])
    job = ledger.start_extract("t0", 0, 3, 0.0, 10.0)
    with pytest.raises(LedgerError):
        ledger.mark_ready(job.job_id, "t1", 3)          # another target
    with pytest.raises(LedgerError, match="stale"):
        ledger.mark_ready(job.job_id, "t0", 2)          # stale generation
    with pytest.raises(LedgerError):
        ledger.start_training(job.job_id, "d0", 0.0, 1.0)   # not ready yet
    ledger.mark_ready(job.job_id, "t0", 3)
    with pytest.raises(LedgerError):
        ledger.mark_ready(job.job_id, "t0", 3)          # twice
    with pytest.raises(LedgerError):
        ledger.mark_consumed(job.job_id, "d0")          # not training
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id], "d0", 0)            # not consumed
    ledger.start_training(job.job_id, "d0", 0.0, 10.0)
    with pytest.raises(LedgerError):
        ledger.start_training(job.job_id, "d1", 0.0, 10.0)   # already taken
    with pytest.raises(LedgerError):
        ledger.mark_consumed(job.job_id, "d1")          # another drafter
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id], "d0", 0)            # training, not consumed
    ledger.mark_consumed(job.job_id, "d0")
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id], "d1", 0)            # committed by another drafter
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id, job.job_id], "d0", 0)    # same job twice
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id, make_job_id(0, 99)], "d0", 0)   # unknown job
    with pytest.raises(LedgerError):
        ledger.mark_ready(make_job_id(5, 0), "t0", 1)
    assert job.state is C and ledger.epochs[0].committed == 0
    ledger.commit([job.job_id], "d0", 0)
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id], "d0", 1)            # committed twice
    with pytest.raises(LedgerError):
        ledger.give_back(job)                           # nothing to give back
    assert ledger.epochs[0].committed == 1
    check_counts(ledger)


def test_commit_is_all_or_nothing():
    ledger = ledger_with([0, 1, 2])
    a = to_consumed(ledger, slot=0)
    b = to_ready(ledger, slot=1)
    ledger.start_training(b.job_id, "d0", 0.0, 10.0)   # training, not consumed
    with pytest.raises(LedgerError):
        ledger.commit([a.job_id, b.job_id], "d0", 0)
    assert a.state is C and b.state is T and a.step is None
    assert ledger.epochs[0].committed == 0
    check_counts(ledger)


def test_no_pending_job():
    ledger = ledger_with([0])
    ledger.start_extract("t0", 0, 1, 0.0, 1.0)
    assert ledger.peek_pending() is None
    with pytest.raises(LedgerError):
        ledger.start_extract("t0", 1, 1, 0.0, 1.0)


def test_add_epoch_twice_raises():
    ledger = ledger_with([0])
    with pytest.raises(LedgerError):
        ledger.add_epoch(0, batches([1]))


def test_extracting_give_back_returns_to_head_in_original_order():
    ledger = ledger_with([0, 1, 2, 0, 1])
    jobs = [ledger.start_extract("t0", i, 1, 0.0, 10.0) for i in range(3)]
    assert [j.job_id for j in jobs] == [make_job_id(0, i) for i in range(3)]
    assert ledger.give_back(jobs[1]) is X
    assert ledger.give_back(jobs[0]) is X
    assert jobs[0].state is P and jobs[0].holder is None and jobs[0].slot is None
    assert jobs[0].times_given_back == 1
    assert ledger.held_by("t0") == [jobs[2]]
    check_counts(ledger)
    again = [ledger.start_extract("t1", 9, 2, 0.0, 10.0).job_id for _ in range(3)]
    assert again == [make_job_id(0, 0), make_job_id(0, 1), make_job_id(0, 3)]
    check_counts(ledger)


def test_training_give_back_goes_to_ready_with_its_slot():
    ledger = ledger_with([0, 1, 0])
    jobs = [to_ready(ledger, slot=s) for s in (4, 5, 6)]
    for job in jobs:
        ledger.start_training(job.job_id, "d0", 0.0, 10.0)
    assert ledger.epochs[0].consumed_order == [0, 1, 0] and ledger.epochs[0].taken == Counter({0: 2, 1: 1})
    assert ledger.give_back(jobs[1]) is T
    assert (jobs[1].state, jobs[1].holder, jobs[1].slot) == (R, None, 5)
    assert ledger.epochs[0].consumed_order == [0, 0] and ledger.epochs[0].taken[1] == 0
    check_counts(ledger)
    # another drafter can take it now
    ledger.start_training(jobs[1].job_id, "d1", 0.0, 10.0)
    assert jobs[1].holder == "d1" and ledger.epochs[0].consumed_order == [0, 0, 1]
    check_counts(ledger)


def test_consumed_give_back_goes_to_pending_head():
    ledger = ledger_with([0, 1, 2, 2])
    first = to_consumed(ledger, slot=0)
    assert ledger.peek_pending().job_id == make_job_id(0, 1)
    assert ledger.give_back(first) is C
    assert (first.state, first.holder, first.slot) == (P, None, None)
    assert ledger.peek_pending() is first
    assert ledger.epochs[0].consumed_order == [] and +ledger.epochs[0].taken == Counter()
    check_counts(ledger)
    with pytest.raises(LedgerError):
        ledger.commit([first.job_id], "d0", 0)


def test_release_worker():
    ledger = ledger_with([0, 1, 2, 1])
    consumed = to_consumed(ledger, "d0", slot=0)
    training = to_ready(ledger, slot=1)
    ledger.start_training(training.job_id, "d0", 0.0, 10.0)
    extracting = ledger.start_extract("t0", 2, 1, 0.0, 10.0)
    other = to_consumed(ledger, "d1", slot=3)
    released = ledger.release_worker("d0")
    assert sorted((j.job_id, s) for j, s in released) == [(consumed.job_id, C), (training.job_id, T)]
    assert consumed.state is P and training.state is R
    assert ledger.held_by("d0") == [] and ledger.release_worker("d0") == []
    assert extracting.holder == "t0" and other.holder == "d1" and other.state is C
    assert ledger.epochs[0].consumed_order == [other.bucket]
    check_counts(ledger)
    assert ledger.release_worker("t0") == [(extracting, X)]
    assert extracting.state is P
    assert ledger.release_worker("nobody") == []
    check_counts(ledger)


def test_drop_ready_goes_back_to_pending():
    ledger = ledger_with([0, 1])
    job = to_ready(ledger, slot=3)
    ledger.drop_ready(job)
    assert job.state is P and job.slot is None and ledger.peek_pending() is job
    with pytest.raises(LedgerError):
        ledger.drop_ready(job)
    check_counts(ledger)


def test_lease_expiry():
    ledger = ledger_with([0, 1, 2, 0])
    extracting = ledger.start_extract("t0", 0, 1, now=0.0, lease_s=10.0)
    ready = to_ready(ledger, slot=1)
    training = to_ready(ledger, slot=2)
    ledger.start_training(training.job_id, "d0", now=5.0, lease_s=10.0)   # deadline 15
    consumed = to_consumed(ledger, "d1", slot=3)
    assert ledger.expired(9.9) == []
    assert ledger.expired(10.0) == []                       # at the deadline it still holds
    assert ledger.expired(10.5) == [extracting]
    assert sorted(j.job_id for j in ledger.expired(100.0)) == sorted([extracting.job_id, training.job_id])
    assert ready not in ledger.expired(1e9) and consumed not in ledger.expired(1e9)


def test_add_epoch_keeps_committed_jobs_committed():
    committed = [make_job_id(0, 1), make_job_id(0, 3)]
    ledger = ledger_with([0, 1, 2, 1, 0], committed=committed)
    assert [ledger.jobs[j].state for j in sorted(ledger.jobs)] == [P, K, P, K, P]
    assert ledger.num_pending == 3 and ledger.count(0, P) == 3 and ledger.count(0, K) == 2
    assert ledger.epochs[0].committed == 2 and ledger.epochs[0].taken == Counter({1: 2})
    assert ledger.epochs[0].bucket_totals == {0: 2, 1: 2, 2: 1}
    handed = [ledger.start_extract("t0", i, 1, 0.0, 1.0).job_id for i in range(3)]
    assert handed == [make_job_id(0, 0), make_job_id(0, 2), make_job_id(0, 4)]
    assert ledger.peek_pending() is None
    check_counts(ledger)
    for job_id in handed:
        ledger.mark_ready(job_id, "t0", 1)
        ledger.start_training(job_id, "d0", 0.0, 1.0)
        ledger.mark_consumed(job_id, "d0")
    ledger.commit(handed, "d0", 9)
    assert ledger.epoch_complete(0)
    check_counts(ledger)


def test_add_epoch_with_committed_ids_of_several_epochs():
    """A restart knows the committed jobs of every epoch at once and adds the epochs one by one."""
    committed = {make_job_id(0, 0), make_job_id(0, 2), make_job_id(1, 1)}
    ledger = JobLedger()
    ledger.add_epoch(0, batches([0, 1, 0]), committed=committed)
    ledger.add_epoch(1, batches([1, 1, 0, 2]), committed=committed)
    assert ledger.epochs[0].committed == 2 and ledger.epochs[1].committed == 1
    assert ledger.count(0, K) == 2 and ledger.count(1, K) == 1
    assert ledger.epochs[0].taken == Counter({0: 2}) and +ledger.epochs[1].taken == Counter({1: 1})
    assert ledger.num_pending == 4
    check_counts(ledger)


def test_add_epoch_ignores_committed_ids_of_other_epochs():
    ledger = JobLedger()
    ledger.add_epoch(0, batches([0, 1]))
    ledger.add_epoch(1, batches([0, 1]), committed=[make_job_id(0, 0), make_job_id(0, 1)])
    assert ledger.epochs[1].committed == 0 and not ledger.epoch_complete(1)
    assert sum(ledger.epochs[1].taken.values()) == 0
    assert ledger.count(1, P) == 2
    check_counts(ledger)


def test_pending_queue_spans_epochs_in_order():
    ledger = JobLedger()
    ledger.add_epoch(0, batches([0, 1]))
    ledger.add_epoch(1, batches([2, 2]))
    order = [ledger.start_extract("t0", i, 1, 0.0, 1.0).job_id for i in range(4)]
    assert order == [make_job_id(0, 0), make_job_id(0, 1), make_job_id(1, 0), make_job_id(1, 1)]
    ledger.give_back(ledger.jobs[make_job_id(1, 0)])
    ledger.give_back(ledger.jobs[make_job_id(0, 1)])
    assert ledger.start_extract("t0", 9, 1, 0.0, 1.0).job_id == make_job_id(0, 1)
    check_counts(ledger)


def test_counts_through_a_random_walk():
    """Drive many jobs through transitions and give-backs; counts stay consistent at every step."""
    import random
    rng = random.Random(4)
    ledger = JobLedger()
    ledger.add_epoch(0, batches([rng.randrange(3) for _ in range(40)]))
    ledger.add_epoch(1, batches([rng.randrange(3) for _ in range(20)]))
    step = 0
    for _ in range(2000):
        jobs = list(ledger.jobs.values())
        action = rng.randrange(6)
        if action == 0 and ledger.peek_pending() is not None:
            ledger.start_extract(rng.choice(["t0", "t1"]), 0, 1, 0.0, 1.0)
        elif action == 1:
            cands = [j for j in jobs if j.state is X]
            if cands:
                j = rng.choice(cands)
                ledger.mark_ready(j.job_id, j.holder, 1)
        elif action == 2:
            cands = [j for j in jobs if j.state is R]
            if cands:
                ledger.start_training(rng.choice(cands).job_id, rng.choice(["d0", "d1"]), 0.0, 1.0)
        elif action == 3:
            cands = [j for j in jobs if j.state is T]
            if cands:
                j = rng.choice(cands)
                ledger.mark_consumed(j.job_id, j.holder)
        elif action == 4:
            for drafter in ("d0", "d1"):
                held = [j.job_id for j in ledger.held_by(drafter) if j.state is C]
                if held:
                    ledger.commit(held, drafter, step)
                    step += 1
        elif rng.random() < 0.3:
            cands = [j for j in jobs if j.state in (X, T, C)]
            if cands:
                ledger.give_back(rng.choice(cands))
        check_counts(ledger)
    assert ledger.counts_by_state()["committed"] > 10
