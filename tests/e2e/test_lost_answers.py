"""Answers the dispatcher never gave: what a drafter said or sent while it died is not lost.

A checkpoint that became durable while no dispatcher listened: the run still ends. The order is forced: the dispatcher is SIGKILLed first, then a drafter holding committed steps past
its last checkpoint is stopped, so its stop-time checkpoint lands on disk and its report finds no
dispatcher. A new dispatcher replays the journal (that model's known checkpoint is behind its step) and the other
drafter commits every remaining job. The stopped drafter never comes back, so no report will come:
the dispatcher finds the checkpoint on disk and the run ends. (A drafter that does come back says
the checkpoint it holds when it registers: tests/dispatcher/test_core_resume.py.)
"""

from __future__ import annotations

import os
import signal

from common import faults
from dispatcher.journal import read_journal
from dispatcher.journal_events import ModelRolledBack, StepCommitted
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd, stats, wait_for_stats


def _write_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("\n".join([
        "run: {epochs: 1}", "data: {synthetic_samples: 300}", "target: {sim: true, sim_cost_per_token: 2.0e-5}",
        "drafter: {sim: true, checkpoint_every: 1000}",  # no checkpoint before the stop
        "dispatcher: {heartbeat_s: 0.2, worker_timeout_s: 3}"]) + "\n")
    return ["--config", str(path)]


def _worker(snapshot, name):
    return next((w for w in snapshot["workers"] if w["name"] == name), None)


def test_checkpoint_durable_while_the_dispatcher_was_down_reaches_it(run_dir, tmp_path):
    args = [*_write_config(tmp_path), f"run.dir={run_dir}"]
    procs = {}
    try:
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher1.log")
        for name in ("target-0", "target-1", "drafter-0", "drafter-1"):
            procs[name] = start_hsd(name.split("-")[0], *args, "--name", name, log_path=tmp_path / f"{name}.log")
        wait_for_stats(run_dir, lambda s: (_worker(s, "drafter-1") or {}).get("jobs", 0) > 0
                       and (_worker(s, "drafter-0") or {}).get("jobs", 0) > 0, 120,
                       what="both drafters to commit work")

        os.kill(procs["dispatcher"].pid, signal.SIGKILL)
        procs["dispatcher"].wait(timeout=10)
        procs["drafter-1"].send_signal(signal.SIGTERM)
        assert procs["drafter-1"].wait(timeout=120) == 0
        assert "saved, but not acknowledged" in (tmp_path / "drafter-1.log").read_text()

        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher2.log")
        wait_for_stats(run_dir, lambda s: s["jobs_by_state"].get("committed", 0) == sum(e["jobs"] for e in s["epochs"])
                       and sum(e["jobs"] for e in s["epochs"]) > 0, 180, what="every job committed by drafter-0")
        assert procs["dispatcher"].wait(timeout=120) == 0, (
            f"{(tmp_path / 'dispatcher2.log').read_text()[-3000:]}\nstats: {stats(run_dir)}")
        for name, proc in procs.items():
            if name not in ("dispatcher", "drafter-1"):
                assert proc.wait(timeout=60) == 0, name
    finally:
        for proc in procs.values():
            kill_tree(proc)
    r = report(run_dir)
    assert_exactly_once(r)
    assert r["restarts"] == 1


def test_a_commit_durable_whose_reply_never_came_is_applied_not_rolled_back(run_dir, tmp_path, monkeypatch):
    """The dispatcher exits with a drafter's commit on disk and its reply not sent (test fault): the
    drafter keeps the step's gradients, and when it registers with the next dispatcher, which holds
    that commit, it applies the step — no committed step rolled back or trained twice."""
    monkeypatch.setenv(faults.ENV, "dispatcher_exit_before_commit_reply=3")
    args = [*_write_config(tmp_path), f"run.dir={run_dir}"]
    procs = {}
    try:
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher1.log")
        for name in ("target-0", "drafter-0"):
            procs[name] = start_hsd(name.split("-")[0], *args, "--name", name, log_path=tmp_path / f"{name}.log")
        assert procs["dispatcher"].wait(timeout=180) == 9, (tmp_path / "dispatcher1.log").read_text()[-3000:]
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher2.log")
        assert procs["dispatcher"].wait(timeout=240) == 0, (tmp_path / "dispatcher2.log").read_text()[-3000:]
        for name in ("target-0", "drafter-0"):
            assert procs[name].wait(timeout=60) == 0, name
    finally:
        for proc in procs.values():
            kill_tree(proc)
    events = list(read_journal(run_dir))
    steps = [e.step for e in events if isinstance(e, StepCommitted)]
    assert steps == list(range(1, len(steps) + 1)), "a step was committed twice or rolled back"
    assert not [e for e in events if isinstance(e, ModelRolledBack) and e.jobs]
    assert "committed: applied" in (tmp_path / "drafter-0.log").read_text()
    assert_exactly_once(report(run_dir))
