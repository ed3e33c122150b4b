"""benchmarks/pipeline.py: `hsd bench pipeline` runs three real launches through the CLI.

A small bench (2 targets, 1 drafter, a few dozen samples, costs scaled down): the JSON has every
figure per policy, the naive policy really serves per-target queues (read from its journal), the
three policies train on the same samples, and nothing is left running or in /dev/shm. The speed
figures themselves belong to the benchmark's output, not to this test.
"""

import json
import subprocess
import sys

import numpy as np

from benchmarks.pipeline import JSON_KEYS, POLICIES
from benchmarks.pipeline_figures import target_queues
from common.dataplane.shm_arena import list_segments
from common.run.records.events import JobConsumed, JobReady, StepCommitted
from common.run.records.journal import read_journal
from common.run.records.schedule import load_schedule
from common.wire.client import run_id_for
from hsd_testing import assert_session_ended, run_hsd_in_session
from ops.report import build_report

SMALL_COSTS = ("target.sim_cost_per_token=1e-6", "target.sim_cost_attention=1e-9",
               "drafter.sim_cost_per_token=1e-5", "drafter.sim_cost_per_sequence=2e-2")
# The measurement window opens when the last worker has registered. With the whole epoch (20 jobs)
# fitting in the pool and taking a few tenths of a second, a worker slow to start on a loaded host
# left no target work inside the window (efficiency 0). Fewer slots than jobs make each extraction
# past the 8th wait for a slot the drafter frees, and the drafter's cost spreads the epoch over
# about 2.5 s: a worker would have to start that much later than the others to empty the window.
POOL_SLOTS = 8


def test_bench_pipeline_small_topology(tmp_path):
    runs, plot = tmp_path / "runs", tmp_path / "pipeline.png"
    run = run_hsd_in_session("bench", "pipeline", "--topology", "2x1", "--samples", "60", "--seed", "5", "--json",
                             "--runs-dir", str(runs), "--plot", str(plot), *SMALL_COSTS, f"pool.slots={POOL_SLOTS}",
                             timeout=300)
    assert_session_ended(run.sid)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)

    assert result["setup"]["num_targets"] == 2 and result["setup"]["num_drafters"] == 1
    for name in POLICIES:
        figures = result[name]
        for key in JSON_KEYS:
            assert key in figures, (name, key)
        assert figures["exactly_once"], name
        # the slower stage's busy share of the window: a worker's busy intervals never overlap
        assert 0.0 < figures["efficiency"] <= 1.0, (name, figures)
        assert 0.0 <= figures["drafter_wait"] <= 1.0 and 0.0 <= figures["target_idle"] <= 1.0
        assert figures["peak_pool_bytes"] > 0
        # the run's own figure (hsd report of its run directory), a share of its steps
        assert figures["step_mix"] == build_report(runs / name)["step_mix"] and 0.0 <= figures["step_mix"] <= 1.0
    assert result["fair"]["step_mix"] >= result["naive"]["step_mix"]

    # naive: every job a target extracted has an index congruent to its queue mod 2, both queues served
    naive = target_queues(list(read_journal(runs / "naive")))
    assert sorted(naive["queue"].values()) == [0, 1]
    for worker, indices in naive["extracted"].items():
        assert indices and all(i % 2 == naive["queue"][worker] for i in indices), (worker, indices)
    # the shared queue: targets take jobs of either residue
    fair_events = list(read_journal(runs / "fair"))
    assert sum(isinstance(e, JobReady) for e in fair_events) > POOL_SLOTS  # the premise of the window's figures
    fair = target_queues(fair_events)
    assert all(q is None for q in fair["queue"].values())
    assert {i % 2 for indices in fair["extracted"].values() for i in indices} == {0, 1}

    # the same samples for every policy, and the same shuffled schedule for the two shuffle policies
    fingerprints = {(runs / name / "data_fingerprint").read_text() for name in POLICIES}
    assert len(fingerprints) == 1
    shuffled = [load_schedule(runs / name, 0) for name in ("naive", "random-pool")]
    assert np.array_equal(shuffled[0].job_bucket, shuffled[1].job_bucket)
    assert np.array_equal(shuffled[0].job_samples, shuffled[1].job_samples)

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in POLICIES:
        assert not list_segments(run_id_for(runs / name))


def test_bad_topology_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "hsd.cli", "bench", "pipeline", "--topology", "5by3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TARGETSxDRAFTERS" in proc.stderr


def test_a_workers_busy_intervals_never_overlap():
    """A step's busy seconds are spread evenly over its jobs from when each was consumed: jobs
    consumed close together would overlap and count the drafter busy twice over. Each job's
    interval belongs to the rank that consumed it (a group's rank 0 commits every rank's jobs)."""
    from benchmarks.pipeline_figures import busy_intervals
    events = [JobReady(w="t0", t=1.0, job=1, busy_s=0.5, tokens=10),
              JobReady(w="t0", t=1.2, job=2, busy_s=0.5, tokens=10),  # reported overlapping
              JobConsumed(w="d0", t=2.0, job=1, bucket=0), JobConsumed(w="d0", t=2.1, job=2, bucket=0),
              JobConsumed(w="d1", t=2.0, job=3, bucket=0),
              StepCommitted(w="d0", t=3.0, model="m", step=1, jobs=[1, 2, 3], busy_s=1.2, tokens=30)]
    intervals = busy_intervals(events)
    assert [(i.start, i.end) for i in intervals["target"]] == [(0.5, 1.0), (1.0, 1.2)]
    drafter = {(i.worker, round(i.start, 6), round(i.end, 6)) for i in intervals["drafter"]}
    assert drafter == {("d0", 2.0, 2.4), ("d0", 2.4, 2.8), ("d1", 2.0, 2.4)}
