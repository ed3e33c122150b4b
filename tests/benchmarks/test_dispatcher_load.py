"""`hsd bench dispatcher`: the real core under simulated load, at a small size, through the CLI."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from benchmarks.dispatcher_load import DispatcherLoad, samples_for_jobs
from benchmarks.load_clients import SimDrafter, SimModel
from benchmarks.pool_pick import SIZES
from common.run.records.job_ids import make_job_id
from hsd_testing import hsd

KEYS = {"ops_per_s", "op_p99_ms", "stall_max_ms", "giveback_max_ms", "restart_s", "rss_mb", "rss_growth",
        "epoch_build_s", "build_waits"}


def test_small_run_commits_every_job_exactly_once_by_the_models_witness(tmp_path):
    proc = hsd("bench", "dispatcher", "--jobs", "3000", "--epochs", "2", "--json", "--dir", str(tmp_path))
    result = json.loads(proc.stdout)
    assert KEYS <= set(result)
    assert len(result["rss_mb"]) == 2 and len(result["epoch_build_s"]) == 2
    assert result["ops"] > 4 * sum(result["jobs_per_epoch"]) and result["ops_per_s"] > 0
    assert 0 < result["op_p99_ms"] <= result["stall_max_ms"]
    # the storm happened: workers died holding jobs, and their give-backs were timed
    storm = result["storm"]
    assert storm["dead_target_jobs"] > 0 and storm["dead_drafter_jobs"] > 0
    assert storm["rolled_back_steps"] > 0      # the dead drafter's model reloaded an older checkpoint
    assert result["given_back"].get("dead", 0) >= storm["dead_target_jobs"] + storm["dead_drafter_jobs"]
    assert result["giveback_max_ms"] > 0
    # the witness: the models' own trained-job lists hold every job of both epochs once
    assert result["witness"] == "lists"
    assert result["num_jobs"] == sum(result["jobs_per_epoch"]) == result["num_trained"]
    assert result["duplicates"] == 0 and result["missing"] == 0 and result["exactly_once"] is True
    assert result["restart_answer"] == "done" and result["restart_s"] > 0
    assert os.listdir(tmp_path) == []          # the temporary run directory is gone (no slot memory exists)
    # the pick across nodes, timed: every drafter of every node was served, each node kept topped up
    picks = result["pick_across_nodes"]
    assert [(p["nodes"], p["ready"]) for p in picks] == [(n, n * r) for n, r in SIZES]
    assert all(p["served"] == p["picks"] and p["pick_us"] > 0 for p in picks)


def test_witness_check_catches_a_job_trained_twice_or_never():
    for full in (True, False):
        models = [SimModel("a", full=full), SimModel("b", full=full)]
        models[0].train([make_job_id(0, 0), make_job_id(0, 1)])
        models[1].train([make_job_id(0, 2), make_job_id(1, 0)])
        load = SimpleNamespace(drafters=[SimDrafter(f"d{i}", m, []) for i, m in enumerate(models)],
                               core=SimpleNamespace(epoch_jobs={0: 3, 1: 1}))
        assert DispatcherLoad.check_witness(load)["exactly_once"] is True
        models[1].train([make_job_id(0, 1)])                  # trained twice, by another model
        assert DispatcherLoad.check_witness(load)["exactly_once"] is False
        models[0].crash()                                     # back to its (empty) checkpoint: three never trained
        models[1].crash()
        assert DispatcherLoad.check_witness(load)["exactly_once"] is False


def test_sample_count_gives_about_the_requested_jobs():
    assert abs(samples_for_jobs(1_000_000) / 1_000_000 - 3.27) < 0.05


def test_bad_options_are_refused_with_a_message(tmp_path):
    proc = hsd("bench", "dispatcher", "--jobs", "5", "--dir", str(tmp_path), check=False)
    assert proc.returncode == 2 and "--jobs must be at least 10" in proc.stderr
    proc = hsd("bench", "dispatcher", "--jobs", "100", "--targets", "1", check=False)
    assert proc.returncode == 2 and "storm" in proc.stderr
