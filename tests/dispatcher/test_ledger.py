"""dispatcher/ledger.py: job states, transitions, give-backs, leases, rollback, epoch progress."""

import random
from collections import Counter

import numpy as np
import pytest

from common.run.records.job_ids import make_job_id, split_job_id
from dispatcher.ledger import NOT_COMMITTED, JobLedger, JobState, LedgerError

P, X, R, T, C, K = (JobState.PENDING, JobState.EXTRACTING, JobState.READY, JobState.TRAINING, JobState.CONSUMED,
                    JobState.COMMITTED)


def ledger_with(*epochs):
    ledger = JobLedger()
    for epoch, buckets in enumerate(epochs):
        ledger.add_epoch(epoch, np.asarray(buckets, dtype=np.int16))
    return ledger


def check_counts(ledger):
    """count() and counts_by_state() agree with the per-job state arrays."""
    for epoch, progress in ledger.epochs.items():
        actual = Counter(ledger.state_of(make_job_id(epoch, i)) for i in range(progress.num_jobs))
        for state in JobState:
            assert ledger.count(epoch, state) == actual[state], (epoch, state)
        assert progress.committed == actual[K]
        assert sum(progress.taken.values()) == actual[T] + actual[C] + actual[K] == progress.num_taken
        assert (progress.commit_step != NOT_COMMITTED).sum() == actual[K]
    assert ledger.num_pending == ledger.counts_by_state()["pending"]
    assert all(job.state not in (P, K) for job in ledger.jobs.values())


def to_consumed(ledger, drafter="d0", target="t0", slot=0):
    job = ledger.start_extract(target, slot, 1, 0.0, 10.0)
    ledger.mark_ready(job.job_id, target, 1)
    ledger.start_training(job.job_id, drafter, 0.0, 10.0)
    ledger.mark_consumed(job.job_id, drafter)
    return job


def test_job_ids():
    assert split_job_id(make_job_id(3, 17)) == (3, 17)
    assert make_job_id(1, 0) > make_job_id(0, 999_999)


def test_full_path_and_commit():
    ledger = ledger_with([0, 1, 0])
    job = ledger.start_extract("t0", 5, 1, 0.0, 10.0)
    assert (job.job_id, job.state, job.holder, job.slot, job.bucket) == (0, X, "t0", 5, 0)
    ledger.mark_ready(0, "t0", 1)
    assert job.state is R and job.holder is None
    ledger.start_training(0, "d0", 1.0, 10.0)
    ledger.mark_consumed(0, "d0")
    assert ledger.held_by("d0") == [job]
    ledger.commit([0], "d0", "m", 1)
    assert ledger.state_of(0) is K and 0 not in ledger.jobs and ledger.model_step["m"] == 1
    assert ledger.last_commit["m"] == (1, (0,))
    check_counts(ledger)


def test_wrong_transitions_raise():
    ledger = ledger_with([0, 0])
    job = ledger.start_extract("t0", 0, 1, 0.0, 10.0)
    with pytest.raises(LedgerError):
        ledger.mark_ready(job.job_id, "t1", 1)          # another target
    with pytest.raises(LedgerError, match="stale"):
        ledger.mark_ready(job.job_id, "t0", 2)          # another generation
    with pytest.raises(LedgerError):
        ledger.start_training(job.job_id, "d0", 0.0, 1.0)  # not ready yet
    with pytest.raises(LedgerError):
        ledger.commit([job.job_id], "d0", "m", 1)
    with pytest.raises(LedgerError, match="unknown"):
        ledger.mark_consumed(make_job_id(7, 0), "d0")


def test_commit_is_all_or_nothing_and_steps_follow_each_other():
    ledger = ledger_with([0, 1, 2])
    a, b = to_consumed(ledger), to_consumed(ledger)
    with pytest.raises(LedgerError):
        ledger.commit([a.job_id, 2], "d0", "m", 1)      # job 2 is pending
    with pytest.raises(LedgerError, match="twice"):
        ledger.commit([a.job_id, a.job_id], "d0", "m", 1)
    with pytest.raises(LedgerError, match="does not follow"):
        ledger.commit([a.job_id], "d0", "m", 2)
    assert a.state is C and b.state is C
    ledger.commit([a.job_id, b.job_id], "d0", "m", 1)
    check_counts(ledger)


def test_give_backs():
    ledger = ledger_with([0, 1, 2, 0])
    first = ledger.start_extract("t0", 0, 1, 0.0, 10.0)
    second = ledger.start_extract("t0", 1, 1, 0.0, 10.0)
    assert ledger.give_back(first) is X and ledger.give_back(second) is X
    assert ledger.peek_pending() == first.job_id         # back at the head, original order
    again = ledger.start_extract("t1", 0, 2, 0.0, 10.0)
    assert again.job_id == first.job_id
    ledger.mark_ready(again.job_id, "t1", 2)
    ledger.start_training(again.job_id, "d0", 0.0, 10.0)
    assert ledger.give_back(again) is T and again.state is R   # the slot still holds it
    ledger.start_training(again.job_id, "d0", 0.0, 10.0)
    ledger.mark_consumed(again.job_id, "d0")
    assert ledger.give_back(again) is C and ledger.state_of(again.job_id) is P
    with pytest.raises(LedgerError):
        ledger.give_back(again)
    check_counts(ledger)


def test_lease_expiry():
    ledger = ledger_with([0, 0])
    job = ledger.start_extract("t0", 0, 1, 0.0, 5.0)
    assert ledger.expired(4.0) == [] and ledger.expired(6.0) == [job]


def test_rollback_returns_a_models_later_commits_to_pending():
    ledger = ledger_with([0, 1, 0, 1, 0, 1])
    steps = []
    for step in (1, 2, 3):
        jobs = [to_consumed(ledger).job_id, to_consumed(ledger).job_id]
        ledger.commit(jobs, "d0", "m", step)
        steps.append(jobs)
    reverted = ledger.rollback("m", 1)
    assert sorted(reverted) == sorted(steps[1] + steps[2])
    assert all(ledger.state_of(j) is P for j in reverted) and ledger.model_step["m"] == 1
    assert ledger.peek_pending() == min(reverted)
    with pytest.raises(LedgerError, match="ahead"):
        ledger.rollback("m", 5)
    assert ledger.rollback("other", 0) == []
    check_counts(ledger)


def test_restore_from_arrays_and_commits():
    ledger = ledger_with([0, 1, 0, 1])
    step = np.array([1, NOT_COMMITTED, 2, NOT_COMMITTED], dtype=np.int64)
    model = np.array([0, -1, 0, -1], dtype=np.int32)
    ledger.model_index["m"] = 0
    ledger.restore_model("m", 2, (2, (2,)))
    ledger.restore_arrays(0, step, model)
    ledger.restore_commit("m", 3, [1])
    assert [ledger.state_of(j) for j in range(4)] == [K, K, K, P]
    assert ledger.peek_pending() == 3 and ledger.model_step["m"] == 3
    with pytest.raises(LedgerError, match="twice"):
        ledger.restore_commit("m", 4, [1])
    check_counts(ledger)


def test_pending_queue_spans_epochs_in_order():
    ledger = ledger_with([0, 1], [2, 2])
    order = [ledger.start_extract("t0", i, 1, 0.0, 10.0).job_id for i in range(4)]
    assert order == [0, 1, make_job_id(1, 0), make_job_id(1, 1)]
    assert ledger.peek_pending() is None


def test_counts_through_a_random_walk():
    rng = random.Random(3)
    ledger = ledger_with([rng.randrange(3) for _ in range(40)], [rng.randrange(3) for _ in range(20)])
    step = 0
    for _ in range(400):
        move = rng.random()
        in_flight = list(ledger.jobs.values())
        if move < 0.3 and ledger.peek_pending() is not None:
            ledger.start_extract("t0", 0, 1, 0.0, 10.0)
        elif move < 0.5 and in_flight:
            job = rng.choice(in_flight)
            if job.state is X:
                ledger.mark_ready(job.job_id, "t0", 1)
            elif job.state is R:
                ledger.start_training(job.job_id, "d0", 0.0, 10.0)
            elif job.state is T:
                ledger.mark_consumed(job.job_id, "d0")
            elif job.state is C:
                step += 1
                ledger.commit([job.job_id], "d0", "m", step)
        elif move < 0.6 and in_flight:
            job = rng.choice(in_flight)
            if job.state in (X, T, C):
                ledger.give_back(job)
        elif move < 0.62 and step:
            step = rng.randrange(step + 1)
            ledger.rollback("m", step)
        check_counts(ledger)


def test_a_job_committed_again_after_a_replayed_rollback_is_not_handed_out():
    """Replaying the journal: commit, rollback (back to pending), commit again. The job must not come
    out of the pending queue once it is committed again."""
    ledger = ledger_with([0, 1, 0])
    ledger.restore_commit("m", 1, [0, 1])
    ledger.rollback("m", 0)
    ledger.restore_commit("m", 1, [0, 1])
    assert ledger.peek_pending() == 2
    assert ledger.start_extract("t0", 0, 1, 0.0, 10.0).job_id == 2
    assert ledger.peek_pending() is None
    check_counts(ledger)
