"""Group steps balanced by cost: the cost model learns a job's cost from the ranks' busy times, and
a cost-balanced group's ranks each take micro-batches until they hold their share of the step."""

from __future__ import annotations

import numpy as np
import pytest
from common.wire.messages import GroupClaim, ModelClaim
from core_harness import make_core, register

from dispatcher.core_types import STEP_FULL
from dispatcher.ledger import LedgerError
from dispatcher.step_balance import CostModel, has_its_share, job_features


def _true_cost(features):
    return 0.02 * features[0] + 0.004 * features[1] + 2e-5 * features[2]  # seconds: per job, sequence, padded token


def test_the_cost_model_learns_a_linear_cost_from_summed_micro_batches():
    rng = np.random.default_rng(0)
    model = CostModel()
    jobs = [job_features(rng.integers(1, 400, size=int(rng.integers(1, 12)))) for _ in range(200)]
    # before any measurement a job costs its padded tokens
    assert model.estimate(jobs[0]) == jobs[0][2]
    for _ in range(120):  # a rank's micro-batches of a step and its measured seconds (5 % noise)
        picked = [jobs[i] for i in rng.integers(0, len(jobs), size=int(rng.integers(1, 5)))]
        summed = sum(picked)
        model.observe(summed, _true_cost(summed) * float(rng.normal(1.0, 0.05)))
    errors = [abs(model.estimate(f) - _true_cost(f)) / _true_cost(f) for f in jobs]
    assert np.median(errors) < 0.1, np.median(errors)
    assert model.observations == 120


def test_observations_without_work_are_ignored():
    model = CostModel()
    model.observe(np.zeros(3), 1.0)
    model.observe(job_features(np.array([10, 20])), 0.0)
    assert model.observations == 0


def test_a_rank_has_its_share_once_one_more_job_would_overshoot_an_even_split():
    loads = {"a": 5.0, "b": 1.0}
    # 4 jobs left at 1.0: the step costs 10, each rank's share is 5
    assert has_its_share(loads, "a", remaining=4, job_cost=1.0, open_ranks=2)
    assert not has_its_share(loads, "b", remaining=4, job_cost=1.0, open_ranks=2)
    # the last rank not told it has its share takes what is left
    assert not has_its_share(loads, "a", remaining=4, job_cost=1.0, open_ranks=1)
    # a full step is full for everyone
    assert has_its_share(loads, "b", remaining=0, job_cost=1.0, open_ranks=2)
    # at a step's start nobody holds anything: each takes jobs
    assert not has_its_share({"a": 0.0, "b": 0.0}, "a", remaining=8, job_cost=1.0, open_ranks=2)


def _rank(core, name, *, balance="cost"):
    return core.register(role="drafter", name=name, pid=3000 + len(core.workers), host="h", gpu=None, now=0.0,
                         model=ModelClaim(id="m", step=0, group=GroupClaim(size=2, balance=balance, accum_steps=3)))


def _two_rank_group(tmp_path, balance):
    # 24 short samples (8 per job: 80 padded tokens) and 10 long ones (2 per job: 500) -> jobs of unequal cost
    core = make_core(tmp_path, lengths=[10] * 24 + [250] * 10, shared_slots=12, credits=12, min_ready=0, epochs=1)
    [target] = register(core, "target", 1)
    a, b = _rank(core, "a", balance=balance), _rank(core, "b", balance=balance)
    version = core.join_group(a.id, 1.0, after=0, step=0).version
    core.join_group(b.id, 1.0, after=0, step=0)
    while (grant := core.get_job(target, 1.0)) is not None and grant != "done":
        core.job_ready(target, grant.job.job_id, grant.job.generation, 0.0, 1.0)
    return core, a, b, version


def test_a_cost_balanced_rank_holding_its_share_is_told_so_and_the_other_fills_the_step(tmp_path):
    core, a, b, version = _two_rank_group(tmp_path, "cost")
    group = core.groups.groups["m"]
    assert group.step_jobs == 6  # accum_steps 3 x drafter.count 2
    held = {a.id: [], b.id: []}
    order = [a.id, b.id] * 6
    full = set()
    for worker in order:  # the ranks ask in turn; one told full asks no more this step
        if worker in full:
            continue
        grant, _ = core.get_hs(worker, 2.0, membership=version)
        if grant == STEP_FULL:
            full.add(worker)
            continue
        assert grant is not None
        held[worker].append(grant.job.job_id)
        core.consumed(worker, grant.job.job_id, 2.0)
    assert sum(map(len, held.values())) == 6  # the step filled
    costs = {w: sum(core.group_ops.costs_of("m").estimate(core.group_ops.job_features(j)) for j in jobs) for w, jobs in held.items()}
    # a took the long jobs and has its share with fewer of them (counted out evenly: 3 each, 1500
    # against 660 padded tokens); the estimated costs end within one job of each other
    assert a.id in full and len(held[a.id]) < len(held[b.id]), held
    biggest = max(core.group_ops.costs_of("m").estimate(core.group_ops.job_features(j)) for jobs in held.values() for j in jobs)
    assert abs(costs[a.id] - costs[b.id]) <= biggest
    # a rank told so polls on as it goes to the all-reduce: that poll waits for the step to commit
    assert full == {a.id, b.id} and core.get_hs(a.id, 2.0, membership=version) == (None, False)
    jobs = held[a.id] + held[b.id]
    core.commit_step(a.id, jobs, 0.5, 3.0, model="m", step=1, membership=version,
                     rank_jobs=[len(held[a.id]), len(held[b.id])], rank_busy_s=[0.3, 0.31])
    assert not group.full and core.group_ops.costs_of("m").observations == 2
    grant, _ = core.get_hs(a.id, 4.0, membership=version)
    assert grant is not None and grant != STEP_FULL  # the next step hands out jobs again


def test_a_count_balanced_group_is_never_told_step_full(tmp_path):
    core, a, b, version = _two_rank_group(tmp_path, "count")
    for _ in range(4):
        for worker in (a.id, b.id):
            grant, _ = core.get_hs(worker, 2.0, membership=version)
            assert grant != STEP_FULL


def test_a_group_spec_with_a_bad_balance_is_refused(tmp_path):
    core = make_core(tmp_path)
    with pytest.raises(LedgerError, match="balance cost or count"):
        core.register(role="drafter", name="x", pid=1, host="h", gpu=None, now=0.0,
                      model=ModelClaim(id="m", step=0, group=GroupClaim(size=2, balance="speed")))
