"""benchmarks/step_balance.py: `hsd bench balance` runs one setup count- and cost-balanced and
reports the all-reduce wait of each, from real group runs (sim targets, two linear ranks with a
modeled per-sequence cost). Which policy waits less is a measurement, printed, not asserted here;
what is checked is that both runs complete exactly once and the cost-balanced one shares its steps
unevenly when the micro-batches' costs differ."""

import json
import shutil
import tempfile

from hsd_testing import assert_session_ended, run_hsd_in_session


def test_balance_bench_runs_both_policies_on_one_setup():
    work = tempfile.mkdtemp(prefix="hsdb-")  # short: each run's ipc sockets live in its run directory
    try:
        run = run_hsd_in_session("bench", "balance", "--setup", "modeled", "--epochs", "1", "--json",
                                 "--dir", work, timeout=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert_session_ended(run.sid)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout)
    runs = {r["step_balance"]: r for r in figures["runs"]}
    assert set(runs) == {"count", "cost"} and all(r["setup"] == "modeled" for r in runs.values())
    for r in runs.values():
        assert r["group_steps"] > 0 and (r["witness_duplicates"], r["witness_missing"]) == (0, 0)
        assert 0 <= r["rank_wait_share"] < 1 and 0 <= r["allreduce_wait_share"] < 1
    step_jobs = 2 * figures["accum_steps"]
    assert runs["count"]["jobs_per_rank_range"][1] == step_jobs // 2  # an even count, never more
    assert runs["cost"]["jobs_per_rank_range"][1] > step_jobs // 2  # a rank took more than half a step
