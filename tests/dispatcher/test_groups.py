"""Elastic data-parallel drafter groups in the pure core: ranks wait, versions open at step
boundaries with every waiting rank, a lost member ends its version without a rollback."""

from __future__ import annotations

import pytest

from core_harness import make_core, register
from common.run.records.events import ModelRolledBack
from common.run.records.journal import read_journal
from common.wire.messages import GroupClaim, ModelClaim, ProtocolError
from dispatcher.groups import GroupChanged
from dispatcher.ledger import JobState, LedgerError


def _rank(core, name, *, step=0, size=2, min_ranks=1, max_ranks=0, now=0.0, **store):
    return core.register(role="drafter", name=name, pid=2000 + len(core.workers), host="h", gpu=None, now=now,
                         model=ModelClaim(id="m", step=step,
                                          group=GroupClaim(size=size, min_ranks=min_ranks, max_ranks=max_ranks, **store)))


def _join(core, worker, *, after=0, step=0, failed=False, now=1.0):
    return core.join_group(worker.id, now, after=after, step=step, failed=failed)


def _fill(core, target, n, now=1.0):
    """Extract ``n`` jobs into ready slots."""
    for _ in range(n):
        grant = core.get_job(target, now)
        core.job_ready(target, grant.job.job_id, grant.job.generation, 0.0, now)


def _consume(core, drafter, membership, now=2.0):
    grant, _ = core.get_hs(drafter, now, membership=membership)
    core.consumed(drafter, grant.job.job_id, now)
    return grant.job


def _lone_rank_stepping(tmp_path, num_steps, *, extra_jobs=0):
    """A core whose 1-rank group ("a") committed ``num_steps`` one-job steps; ``extra_jobs`` more wait ready."""
    core = make_core(tmp_path, shared_slots=8, credits=8, min_ready=0)
    [target] = register(core, "target", 1)
    a = _rank(core, "a", size=1)
    version = _join(core, a).version
    _fill(core, target, num_steps + extra_jobs)
    for step in range(1, num_steps + 1):
        job = _consume(core, a.id, version)
        core.commit_step(a.id, [job.job_id], 0.1, 3.0, model="m", step=step, membership=version)
    return core, a, version


def _rollbacks(run_dir):
    return [e for e in read_journal(run_dir, only=(ModelRolledBack,)) if e.jobs]


def test_a_new_group_waits_for_count_ranks_then_opens_one_version(tmp_path):
    core = make_core(tmp_path)
    a = _rank(core, "a")
    assert _join(core, a) is None  # drafter.count=2: one rank is not a group yet
    b = _rank(core, "b")
    ma, mb = _join(core, a), _join(core, b)
    assert (ma.rank, mb.rank, ma.world_size, ma.version, mb.version) == (0, 1, 2, 1, 1)
    assert ma.store == mb.store and ma.store.startswith(str(tmp_path / "groups" / "m"))
    assert not ma.transfer and ma.step == 0
    with pytest.raises(LedgerError, match="every drafter of the model must agree"):
        _rank(core, "c", size=3)


def test_ranks_that_host_stores_meet_on_rank_0s_under_a_prefix_of_each_version_and_no_file(tmp_path):
    core = make_core(tmp_path)
    a, b = _rank(core, "a", store="10.0.0.1:4001"), _rank(core, "b", store="[fe80::2]:4002")
    ma, mb = _join(core, a), _join(core, b)
    incarnation = core.incarnation
    assert ma.store == mb.store == f"tcp://10.0.0.1:4001/m/i{incarnation}-v1" and ma.rank == 0
    core.deregister(a.id, 2.0, reason="dead")  # rank 0 gone: the next version meets on the survivor's store
    mb = _join(core, b, after=1)
    assert (mb.store, mb.rank) == (f"tcp://[fe80::2]:4002/m/i{incarnation}-v2", 0)
    assert not (tmp_path / "groups").exists()
    with pytest.raises(LedgerError, match="drafter.rendezvous=file, its group meets over tcp"):
        _rank(core, "c")  # every rank of a model meets the same way
    with pytest.raises(ProtocolError, match="model.group.store"):
        _rank(core, "d", store="10.0.0.4")


def test_joiners_wait_for_the_step_boundary_and_all_join_at_once(tmp_path):
    core = make_core(tmp_path, shared_slots=8, credits=8, min_ready=0)
    [target] = register(core, "target", 1)
    a, b = _rank(core, "a"), _rank(core, "b")
    v1 = _join(core, a).version
    _join(core, b)
    _fill(core, target, 4)
    jobs = [_consume(core, a.id, v1), _consume(core, b.id, v1)]
    c, d = _rank(core, "c"), _rank(core, "d")  # two attach mid-step: they wait, the step goes on
    assert _join(core, c) is None and _join(core, d) is None
    assert core.groups.groups["m"].version == v1
    core.commit_step(a.id, [j.job_id for j in jobs], 0.1, 3.0, model="m", step=1, membership=v1)
    # the commit is the step boundary: one new version with the two members and both joiners
    group = core.groups.groups["m"]
    assert group.version == v1 + 1 and group.world_size == 4
    mc = _join(core, c)
    assert mc.version == v1 + 1 and mc.transfer and mc.step == 1 and mc.source == 0
    assert _join(core, a, after=v1, step=1).rank == 0  # rank 0 stays rank 0: it sends the state
    with pytest.raises(GroupChanged):  # a poll of the old version is void
        core.get_hs(b.id, 4.0, membership=v1)
    assert core.ledger.model_step["m"] == 1 and not _rollbacks(tmp_path)


def test_a_member_gone_ends_the_version_the_others_go_on_without_rollback(tmp_path):
    core, ranks, v1, in_flight = _three_ranks_one_step_in_flight(tmp_path)
    core.deregister(ranks[2].id, 5.0, reason="dead")
    # the step in flight goes back (consumed -> pending); the two survivors form the next version as
    # soon as both said the step they hold
    assert all(job_id not in core.ledger.jobs for job_id in in_flight)
    assert core.ledger.count(0, JobState.CONSUMED) == 0 and core.ledger.count(0, JobState.COMMITTED) == 3
    assert _join(core, ranks[1], after=v1, step=1) is None  # rank 0 has not said its step yet
    m0 = _join(core, ranks[0], after=v1, step=1)
    assert (m0.version, m0.world_size, m0.transfer) == (v1 + 1, 2, False)
    assert core.ledger.model_step["m"] == 1 and not _rollbacks(tmp_path)


def test_a_failed_collective_ends_the_version_at_once_and_a_lone_survivor_waits_below_min_ranks(tmp_path):
    core = make_core(tmp_path)
    a, b = _rank(core, "a", min_ranks=2), _rank(core, "b", min_ranks=2)
    v1 = _join(core, a).version
    _join(core, b)
    assert _join(core, a, after=v1) is None  # a member that saw a peer leave waits; the version stands
    assert _join(core, a, after=v1, failed=True) is None  # its collective failed: the version ends now ...
    m = _join(core, b, after=v1, failed=True)  # ... and the next opens once b, whose failed too, said its step
    assert m.version == v1 + 1 and m.world_size == 2  # b is still registered: it is in the next one
    core.deregister(b.id, 2.0, reason="dead")
    assert _join(core, a, after=v1 + 1) is None  # alone, below min_ranks=2: it waits
    c = _rank(core, "c", min_ranks=2, now=3.0)
    mc = _join(core, c)  # min_ranks, not drafter.count, is what survivors wait for
    assert mc.version == v1 + 2 and mc.world_size == 2


def test_max_ranks_keeps_extra_joiners_waiting(tmp_path):
    core = make_core(tmp_path)
    a = _rank(core, "a", size=1, max_ranks=2)
    assert _join(core, a).world_size == 1
    b, c = _rank(core, "b", size=1, max_ranks=2), _rank(core, "c", size=1, max_ranks=2)
    assert _join(core, b).world_size == 2  # nothing in flight: the joiners come in at once, up to max_ranks
    assert _join(core, c) is None
    core.deregister(b.id, 2.0)
    assert _join(core, c) is None  # a has not said the step it holds yet
    assert _join(core, a, after=2).world_size == 2
    assert _join(core, c).world_size == 2


def test_a_group_back_from_its_checkpoint_rolls_the_ledger_back_to_it(tmp_path):
    core, a, _ = _lone_rank_stepping(tmp_path, 2)
    core.deregister(a.id, 4.0, reason="dead")
    again = _rank(core, "a", size=1, step=1, now=5.0)  # its checkpoint holds step 1
    assert _join(core, again, step=1).step == 1
    assert core.ledger.model_step["m"] == 1 and [r.cause for r in _rollbacks(tmp_path)] == ["restart"]


def test_a_joiner_whose_source_died_before_any_step_says_its_step_before_the_ledger_moves(tmp_path):
    core, a, v1 = _lone_rank_stepping(tmp_path, 1)
    b = _rank(core, "b", size=1)
    assert _join(core, b).transfer  # b holds step 0, the version step 1: rank 0 sends it the state
    core.deregister(a.id, 4.0, reason="dead")  # ... and dies before any step: did b get the state?
    assert core.groups.groups["m"].version == v1 + 1 and not core.groups.groups["m"].members
    m = _join(core, b, after=v1 + 1, step=1, failed=True)  # it did: it goes on, no rollback
    assert m.step == 1 and not m.transfer and not _rollbacks(tmp_path)


def test_the_stats_and_metrics_show_the_group(tmp_path):
    from dispatcher.metrics import render_prometheus
    from common.wire import messages
    from common.wire.stats_snapshot import AuthView, TransportView, serving_snapshot
    from dispatcher.snapshot import build_snapshot
    from ops.stats_view import format_stats
    core, a, v1 = _lone_rank_stepping(tmp_path, 2, extra_jobs=1)
    _consume(core, a.id, v1)  # a step in flight: a joiner waits
    _rank(core, "b", size=1)
    s = build_snapshot(core, 4.0)
    assert {k: getattr(s.groups["m"], k) for k in ("world_size", "version", "waiting", "steps_since_change")} == {
        "world_size": 1, "version": v1, "waiting": 1, "steps_since_change": 2}
    served = serving_snapshot(s, run_dir=str(tmp_path), run_id="r", pid=1, waiters=0, auth=AuthView(mechanism="none"),
                              nodes={}, transport=TransportView(kind="shm", num_slots=8, per_target=False, slot_bytes=1,
                                                                pool_bytes=8))
    text = render_prometheus(served)
    assert 'hsd_group_ranks{model="m"} 1.0' in text and 'hsd_group_waiting{model="m"} 1.0' in text
    assert 'hsd_group_steps_since_change{model="m"} 2.0' in text
    assert "group     m: 1 rank(s) [0:d0.0]  membership 1  1 waiting  2 steps since change" in format_stats(served)
    # the stats reply carries it over the wire as it is
    assert messages.decode_reply(messages.encode(messages.StatsReply(id=1, stats=served)), "stats").stats == served


def test_a_restarted_rank_joins_a_live_group_from_an_older_or_a_newer_checkpoint_without_a_rollback(tmp_path):
    core, a, v1 = _lone_rank_stepping(tmp_path, 3)
    old = _rank(core, "b", size=1, step=1, now=4.0)  # restarted from its checkpoint at step 1
    m_old = _join(core, old, step=1, now=4.0)
    assert (m_old.step, m_old.transfer) == (3, True)  # it takes the live step from rank 0
    ahead = _rank(core, "c", size=1, step=5, now=5.0)  # a checkpoint ahead of the ledger a live group holds
    m_ahead = _join(core, ahead, after=m_old.version, step=5, now=5.0)
    assert (m_ahead.step, m_ahead.transfer, m_ahead.world_size) == (3, True, 3)
    assert core.ledger.model_step["m"] == 3 and not _rollbacks(tmp_path)


def test_after_a_dispatcher_restart_the_ranks_holding_the_committed_step_are_waited_for(tmp_path):
    core, a, _ = _lone_rank_stepping(tmp_path, 3)
    core.journal.close()
    core.close()
    core = make_core(tmp_path, worker_timeout_s=5.0, now=10.0)  # the dispatcher restarted: nobody is registered
    assert core.ledger.model_step["m"] == 3
    old = _rank(core, "b", size=1, step=1, now=10.0)  # a restarted rank, from its checkpoint: a live one may come
    assert _join(core, old, step=1, now=11.0) is None and not _rollbacks(tmp_path)
    live = _rank(core, "a", size=1, step=3, now=12.0)  # the live rank registers again with the step it holds
    m = _join(core, live, step=3, now=12.0)
    assert (m.step, m.world_size, m.transfer) == (3, 2, True) and not _rollbacks(tmp_path)
    assert core.ledger.model_step["m"] == 3


def test_after_a_dispatcher_restart_that_finds_no_live_rank_the_group_rolls_back_to_its_checkpoint(tmp_path):
    core, a, _ = _lone_rank_stepping(tmp_path, 3)
    core.journal.close()
    core.close()
    core = make_core(tmp_path, worker_timeout_s=5.0, now=10.0)
    old = _rank(core, "a", size=1, step=1, now=10.0)
    assert _join(core, old, step=1, now=14.0) is None  # within worker_timeout_s a live rank may still come
    m = _join(core, old, step=1, now=15.5)  # none came: the whole group crashed, its checkpoint is the state
    assert m.step == 1 and core.ledger.model_step["m"] == 1 and len(_rollbacks(tmp_path)) == 1


def test_when_the_last_live_rank_leaves_before_its_state_went_out_the_joiner_loads_the_newer_checkpoint(tmp_path):
    core, a, v1 = _lone_rank_stepping(tmp_path, 3)
    core.checkpoint(a.id, 3, 3.5, model="m")
    b = _rank(core, "b", size=1, step=1, now=4.0)  # its checkpoint then was step 1
    assert _join(core, b, step=1, now=4.0).transfer
    core.deregister(a.id, 4.5)  # a detaches before any step of the new version: b never got the state
    assert _join(core, b, after=v1 + 1, step=1, failed=True, now=5.0) is None  # no rollback to step 1 ...
    assert core.checkpoint_to_load(b.id) == 3  # ... b loads the checkpoint of step 3 first
    m = _join(core, b, after=v1 + 1, step=3, now=6.0)
    assert (m.step, m.transfer) == (3, False) and core.ledger.model_step["m"] == 3 and not _rollbacks(tmp_path)


def _three_ranks_one_step_in_flight(tmp_path):
    """Three ranks committed step 1 and consumed step 2's jobs (one each); returns (core, ranks, v1, jobs of step 2)."""
    core = make_core(tmp_path, shared_slots=8, credits=8, min_ready=0)
    [target] = register(core, "target", 1)
    ranks = [_rank(core, n, size=3) for n in "abc"]
    v1 = [_join(core, r) for r in ranks][0].version
    _fill(core, target, 6)
    first = [_consume(core, r.id, v1) for r in ranks]
    core.commit_step(ranks[0].id, [j.job_id for j in first], 0.1, 3.0, model="m", step=1, membership=v1)
    return core, ranks, v1, [_consume(core, r.id, v1).job_id for r in ranks]


def test_rank0_dead_inside_its_commit_the_others_learn_the_step_committed_and_go_on_from_it(tmp_path):
    """Rank 0's commit of step 2 is durable, then it dies before its outcome reaches the others: they
    ask, apply step 2 and form the next version at step 2 — no rollback, a source holding step 2."""
    core, ranks, v1, step2 = _three_ranks_one_step_in_flight(tmp_path)
    core.commit_step(ranks[0].id, step2, 0.1, 4.0, model="m", step=2, membership=v1)
    core.deregister(ranks[0].id, 5.0, reason="dead")
    for r in ranks[1:]:
        assert core.step_outcome(r.id, 5.0, model="m", step=2, job_ids=step2, membership=v1)
    assert core.ledger.model_step["m"] == 2
    assert _join(core, ranks[1], after=v1, step=2, failed=True) is None  # c has not said its step yet
    m = _join(core, ranks[2], after=v1, step=2, failed=True)
    assert (m.step, m.world_size, m.transfer) == (2, 2, False)
    assert core.ledger.model_step["m"] == 2 and not _rollbacks(tmp_path)


def test_a_rank_that_did_not_apply_the_last_step_is_never_taken_to_hold_it(tmp_path):
    """The same death, but one survivor could not ask (it dropped step 2): the next version waits for
    its word and then sends it the state from the rank that holds step 2."""
    core, ranks, v1, step2 = _three_ranks_one_step_in_flight(tmp_path)
    core.commit_step(ranks[0].id, step2, 0.1, 4.0, model="m", step=2, membership=v1)
    core.deregister(ranks[0].id, 5.0, reason="dead")
    assert _join(core, ranks[2], after=v1, step=1, failed=True) is None  # c dropped step 2
    m = _join(core, ranks[1], after=v1, step=2, failed=True)
    assert (m.step, m.world_size, m.transfer) == (2, 2, True)
    assert core.groups.groups["m"].members == {ranks[1].id: 0, ranks[2].id: 1}  # the source holds step 2
    assert core.ledger.model_step["m"] == 2 and not _rollbacks(tmp_path)


def test_a_step_said_not_committed_can_no_longer_commit(tmp_path):
    """A rank asks before rank 0's commit landed: "not committed" holds for good, since its version ends."""
    core, ranks, v1, step2 = _three_ranks_one_step_in_flight(tmp_path)
    assert not core.step_outcome(ranks[1].id, 4.0, model="m", step=2, job_ids=step2, membership=v1)
    with pytest.raises(GroupChanged):
        core.commit_step(ranks[0].id, step2, 0.1, 4.5, model="m", step=2, membership=v1)
    assert core.ledger.model_step["m"] == 1


def test_a_source_that_reports_another_step_than_its_version_ends_it(tmp_path):
    core, a, v1 = _lone_rank_stepping(tmp_path, 2)
    b = _rank(core, "b", size=1)
    m = _join(core, b)
    assert m.transfer and core.groups.groups["m"].members[a.id] == 0  # a holds step 2, the source
    assert _join(core, a, after=v1, step=1) is None  # a says it holds step 1: it cannot be the source
    assert core.groups.groups["m"].version == m.version and not core.groups.groups["m"].members


def test_no_version_opens_once_the_run_is_done(tmp_path):
    core = make_core(tmp_path, epochs=1, shared_slots=16, credits=16, min_ready=0)
    [target] = register(core, "target", 1)
    a, b = _rank(core, "a"), _rank(core, "b")
    version = _join(core, a).version
    _join(core, b)
    _fill(core, target, 12)  # the whole epoch
    while not core.all_committed:
        jobs = [_consume(core, r.id, version).job_id for r in (a, b)]
        core.commit_step(a.id, jobs, 0.1, 3.0, model="m", membership=version)
    core.checkpoint(a.id, core.ledger.model_step["m"], 3.0, model="m")
    assert core.done
    core.deregister(b.id, 4.0)  # the ranks leave as the run ends
    assert _join(core, a, after=version, step=core.ledger.model_step["m"]) is None
    assert core.groups.groups["m"].version == version


def test_a_spec_with_size_outside_min_and_max_ranks_is_refused(tmp_path):
    core = make_core(tmp_path)
    with pytest.raises(LedgerError, match="min_ranks <= size <= max_ranks"):
        _rank(core, "a", size=3, max_ranks=2)
