"""hsd plan: the split arithmetic, the recommendation, and rates read from a journal."""

from __future__ import annotations

import json

from common.run.records.events import DispatcherStarted, JobReady, ModelRolledBack, StepCommitted, WorkerJoined
from common.run.records.journal import encode_event

import pytest

from common.run.config import load_config
from hsd.cli import main
from ops.planner import StageRates, evaluate_split, plan_splits, rates_from_config, rates_from_run, recommend


def test_split_arithmetic_is_pinned():
    rates = StageRates(target=500_000, drafter=1_000_000, source="test")
    s = evaluate_split(rates, 5, 3)
    assert (s.target_capacity, s.drafter_capacity, s.tokens_per_s) == (2_500_000, 3_000_000, 2_500_000)
    assert s.bottleneck == "target"
    assert (s.target_utilization, s.drafter_utilization) == (1.0, pytest.approx(2.5 / 3))
    assert s.idle_share == pytest.approx(1 / 6)  # the drafters wait a sixth of their time
    assert s.gpu_efficiency == pytest.approx((5 + 3 * 2.5 / 3) / 8)  # 93.75% of the GPU time works
    splits = plan_splits(rates, 8)
    assert [(x.targets, x.drafters) for x in splits] == [(t, 8 - t) for t in range(1, 8)]
    assert [x.tokens_per_s for x in splits] == [5e5, 1e6, 1.5e6, 2e6, 2.5e6, 2e6, 1e6]
    assert (recommend(rates, splits).targets, recommend(rates, splits).drafters) == (5, 3)


def test_balanced_split_idles_nothing():
    s = evaluate_split(StageRates(target=100.0, drafter=100.0, source="test"), 2, 2)
    assert (s.bottleneck, s.idle_share, s.gpu_efficiency, s.tokens_per_s) == ("balanced", 0.0, 1.0, 200.0)


def test_ties_give_fewer_gpus_to_the_faster_stage():
    fast_targets = StageRates(target=3.0, drafter=1.0, source="test")
    splits = plan_splits(fast_targets, 5)  # 1+4 and 2+3 both train 3 tokens/s
    assert [s.tokens_per_s for s in splits[:2]] == [3.0, 3.0]
    assert (recommend(fast_targets, splits).targets, recommend(fast_targets, splits).drafters) == (1, 4)
    fast_drafters = StageRates(target=1.0, drafter=3.0, source="test")
    splits = plan_splits(fast_drafters, 5)  # 4+1 and 3+2 both train 3 tokens/s
    assert (recommend(fast_drafters, splits).targets, recommend(fast_drafters, splits).drafters) == (4, 1)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        plan_splits(StageRates(1.0, 1.0, "test"), 1)
    with pytest.raises(ValueError, match="drafter rate"):
        StageRates(1.0, 0.0, "test")


def test_cheap_and_heavy_drafters_get_different_splits():
    cheap = rates_from_config(load_config(None, ["target.sim_cost_per_token=2e-6", "drafter.sim_cost_per_token=1e-6"]))
    heavy = rates_from_config(load_config(None, ["target.sim_cost_per_token=2e-6", "drafter.sim_cost_per_token=4e-6"]))
    best_cheap, best_heavy = recommend(cheap, plan_splits(cheap, 8)), recommend(heavy, plan_splits(heavy, 8))
    # cheap drafter: 5 targets x 500k = 2.5M tok/s, the 3 drafters (3M capacity) idle a sixth of their time
    assert (best_cheap.targets, best_cheap.drafters, best_cheap.bottleneck) == (5, 3, "target")
    assert best_cheap.tokens_per_s == pytest.approx(2.5e6)
    assert best_cheap.idle_share == pytest.approx(1 / 6) and best_cheap.gpu_efficiency == pytest.approx(0.9375)
    # heavy drafter (250k tok/s per GPU): 5 drafters = 1.25M tok/s, the 3 targets (1.5M) idle a sixth
    assert (best_heavy.targets, best_heavy.drafters, best_heavy.bottleneck) == (3, 5, "drafter")
    assert best_heavy.tokens_per_s == pytest.approx(1.25e6)
    assert best_heavy.idle_share == pytest.approx(1 / 6) and best_heavy.gpu_efficiency == pytest.approx(0.9375)


def _journal(run_dir, events):
    run_dir.mkdir()
    (run_dir / "journal.jsonl").write_bytes(b"".join(encode_event(e) for e in events))


def test_rates_from_a_journal(tmp_path):
    run_dir = tmp_path / "run"
    _journal(run_dir, [
        DispatcherStarted(t=0.0),
        WorkerJoined(t=0.1, w="a", role="target", name="target-0"),
        WorkerJoined(t=0.1, w="b", role="target", name="target-1"),
        WorkerJoined(t=0.1, w="c", role="drafter", name="drafter-0"),
        JobReady(t=1.0, job=1, w="a", tokens=8000, busy_s=1.0),
        JobReady(t=1.5, job=2, w="b", tokens=8000, busy_s=3.0),
        StepCommitted(t=2.0, model="m", step=1, jobs=[1], buckets=[0], tokens=8000, busy_s=0.5),
        StepCommitted(t=3.0, model="m", step=2, jobs=[2], buckets=[1], tokens=8000, busy_s=9.0),
        ModelRolledBack(t=4.0, model="m", step=1, jobs=1),  # a redone step: its time is not throughput
        StepCommitted(t=5.0, model="m", step=2, jobs=[2], buckets=[1], tokens=8000, busy_s=0.5),
    ])
    rates = rates_from_run(run_dir)
    assert (rates.target, rates.drafter) == (4000.0, 16000.0)
    assert "2 targets, 1 drafters" in rates.source
    empty = tmp_path / "empty"
    _journal(empty, [DispatcherStarted(t=0.0)])
    with pytest.raises(ValueError, match="no target work"):
        rates_from_run(empty)


def test_cli_plan(capsys, tmp_path):
    assert main(["plan", "--gpus", "8", "drafter.sim_cost_per_token=4e-6", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["recommended"]["targets"], plan["recommended"]["drafters"]) == (3, 5)
    assert len(plan["splits"]) == 7
    assert main(["plan", "--gpus", "4"]) == 0
    text = capsys.readouterr().out
    # 2+2 and 3+1 both train 1M tok/s; drafters are faster per GPU, so they get fewer
    assert "<- recommended" in text and "recommended: 3 target(s) + 1 drafter(s)" in text
    assert main(["plan", "--gpus", "1"]) == 2
    assert main(["plan", "--gpus", "4", "--from", str(tmp_path / "nope")]) == 2


def test_a_target_too_big_for_one_gpu_is_planned_as_a_tensor_parallel_group(capsys):
    from ops.planner import tp_size_for
    memory = tp_size_for(70e9, gpu_memory_gb=80, reserve_gb=16)
    assert (memory.tp_size, memory.weights_gb, memory.per_gpu_gb) == (4, 140.0, 35.0)  # 70 + 16 > 80 at tp_size 2
    assert tp_size_for(8e9, gpu_memory_gb=80, reserve_gb=16).tp_size == 1
    assert tp_size_for(70e9, gpu_memory_gb=141, reserve_gb=16).tp_size == 2
    with pytest.raises(ValueError, match="do not fit 8 GPUs"):
        tp_size_for(700e9, gpu_memory_gb=80, reserve_gb=16)
    rates = StageRates(target=2_500.0, drafter=5_000.0, source="test")  # a group's rate, a drafter GPU's
    splits = plan_splits(rates, 12, tp_size=4)
    assert [(s.targets, s.drafters) for s in splits] == [(1, 8), (2, 4)]
    assert recommend(rates, splits).targets == 2
    assert splits[1].gpu_efficiency == pytest.approx((8 * 1.0 + 4 * 0.25) / 12)
    with pytest.raises(ValueError, match="at least 5 GPUs"):
        plan_splits(rates, 4, tp_size=4)
    assert main(["plan", "--gpus", "8", "--target-params", "70e9", "target.sim_cost_per_token=4e-4"]) == 0
    out = capsys.readouterr().out
    assert "70 x 2 bytes" not in out and "140 GB of weights; tp_size 4: 35.0 GB per GPU" in out
    assert "target.count=1 drafter.count=4 target.tp_size=4" in out
