"""Data-parallel drafter groups in the pure core: ranks, membership versions, group commits."""

from __future__ import annotations

import pytest

from core_harness import make_core, register
from dispatcher.groups import GroupChanged
from dispatcher.ledger import JobState, LedgerError


def _rank(core, name, *, step=0, world_size=2, now=0.0):
    return core.register(role="drafter", name=name, pid=2000 + len(core.workers), host="h", gpu=None, now=now,
                         model={"id": "m", "step": step, "world_size": world_size})


def _fill(core, target, n, now=1.0):
    """Extract ``n`` jobs into ready slots."""
    for _ in range(n):
        grant = core.get_job(target, now)
        core.job_ready(target, grant.job.job_id, grant.job.generation, 0.0, now)


def _consume(core, drafter, now=2.0):
    grant, _ = core.get_hs(drafter, now)
    core.consumed(drafter, grant.job.job_id, now)
    return grant.job


def test_ranks_membership_and_store_path(tmp_path):
    core = make_core(tmp_path)
    a, b = _rank(core, "a"), _rank(core, "b")
    assert (a.group.rank, b.group.rank) == (0, 1)
    assert a.group.version == b.group.version == 1
    assert a.group.store == b.group.store
    assert a.group.store.startswith(str(tmp_path / "groups" / "m"))
    group = core.groups.group_of(a.id)
    assert group is not None and group.formed
    with pytest.raises(LedgerError, match="group of 2 ranks"):
        _rank(core, "c", world_size=3)


def test_group_commit_covers_every_ranks_jobs_and_the_window_spans_the_group(tmp_path):
    core = make_core(tmp_path, shared_slots=8, credits=8, min_ready=0)
    [target] = register(core, "target", 1)
    a, b = _rank(core, "a"), _rank(core, "b")
    _fill(core, target, 5)
    jobs = [_consume(core, a.id), _consume(core, b.id), _consume(core, a.id)]
    # the pull policy saw one window for the group: three micro-batches, three different buckets
    assert len({job.bucket for job in jobs}) == 3
    ids = [job.job_id for job in jobs]
    assert core.commit_step(a.id, ids, 0.1, 3.0, model="m", step=1) == 1
    assert core.commit_step(a.id, ids, 0.1, 3.0, model="m", step=1) == 1  # idempotent
    assert core.ledger.model_step["m"] == 1
    assert core.ledger.count(0, JobState.COMMITTED) == 3
    # a lone drafter still commits only its own jobs
    solo = core.register(role="drafter", name="solo", pid=99, host="h", gpu=None, now=3.0,
                         model={"id": "s", "step": 0})
    mine = _consume(core, solo.id, now=4.0)
    other = _consume(core, b.id, now=4.0)
    with pytest.raises(LedgerError, match="held by"):
        core.commit_step(solo.id, [mine.job_id, other.job_id], 0.1, 4.0, model="s", step=1)


def test_a_member_gone_ends_the_version_and_its_step(tmp_path):
    core = make_core(tmp_path, shared_slots=8, credits=8, min_ready=0)
    [target] = register(core, "target", 1)
    a, b = _rank(core, "a"), _rank(core, "b")
    _fill(core, target, 3)
    job_a, job_b = _consume(core, a.id), _consume(core, b.id)
    core.deregister(b.id, 5.0, reason="dead")
    # the survivor's step is void: its jobs went back, and it is told at once
    assert job_a.job_id not in core.ledger.jobs and job_b.job_id not in core.ledger.jobs  # pending again
    assert core.ledger.count(0, JobState.CONSUMED) == 0
    with pytest.raises(GroupChanged):
        core.get_hs(a.id, 5.0)
    with pytest.raises(GroupChanged):
        core.commit_step(a.id, [job_a.job_id, job_b.job_id], 0.1, 5.0, model="m", step=1)
    # both come back (the survivor under its own name: its old session is replaced, no new bump)
    a2, b2 = _rank(core, "a", now=6.0), _rank(core, "b", now=6.0)
    assert a2.group.version == b2.group.version == 2
    assert {a2.group.rank, b2.group.rank} == {0, 1}
    assert a2.group.store != a.group.store
    assert core.ledger.count(0, JobState.CONSUMED) == 0


def test_a_joiner_at_another_step_starts_a_new_version(tmp_path):
    core = make_core(tmp_path)
    a = _rank(core, "a")
    b = _rank(core, "b", step=0)
    c = _rank(core, "c", step=0)  # the group was formed: a third session starts a new version
    assert c.group.version == 2 and c.group.rank == 0
    with pytest.raises(GroupChanged):
        core.get_hs(a.id, 1.0)
    with pytest.raises(GroupChanged):
        core.get_hs(b.id, 1.0)
