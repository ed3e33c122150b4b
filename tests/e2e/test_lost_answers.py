"""Answers the dispatcher never gave: what a drafter said or sent while it died is not lost.

The order of events is forced: the dispatcher exits with a drafter's commit durable and its reply
not sent (a test fault), so that drafter's step is in the journal and in no answer.
"""

from __future__ import annotations

import signal

from common import faults
from common.run.records.events import ModelRolledBack, StepCommitted
from common.run.records.journal import read_journal
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd


def _write_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("\n".join([
        "run: {epochs: 1}", "data: {synthetic_samples: 300}", "target: {sim: true, sim_cost_per_token: 2.0e-5}",
        "drafter: {sim: true, checkpoint_every: 1000}",  # no checkpoint before the stop
        # a drafter unheard from for abandoned_model_s + worker_timeout_s / 2 saves nothing on its stop
        "dispatcher: {heartbeat_s: 0.2, worker_timeout_s: 3, abandoned_model_s: 6}"]) + "\n")
    return ["--config", str(path)]


def test_a_drafter_stopped_while_its_commit_went_unanswered_never_comes_back_and_the_run_ends(run_dir, tmp_path,
                                                                                             monkeypatch):
    """That drafter is asked to stop: it sends the commit no more, drops the step and saves the step
    it applied, a checkpoint that lands while no dispatcher listens, and exits well within the minute
    the other workers look for a dispatcher. It never comes back. The next dispatcher finds its
    checkpoint on disk, a step behind the model's step in the journal, and with no drafter of that
    model for dispatcher.abandoned_model_s takes the model back to it; the other drafter trains the
    jobs of the lost step with the rest, and the run ends with every job in one checkpoint."""
    monkeypatch.setenv(faults.ENV, "dispatcher_exit_before_commit_reply=3")
    args = [*_write_config(tmp_path), f"run.dir={run_dir}"]
    procs = {}
    try:
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher1.log")
        for name in ("target-0", "target-1", "drafter-0", "drafter-1"):
            procs[name] = start_hsd(name.split("-")[0], *args, "--name", name, log_path=tmp_path / f"{name}.log")
        assert procs["dispatcher"].wait(timeout=180) == 9, (tmp_path / "dispatcher1.log").read_text()[-3000:]
        unanswered = next(e for e in read_journal(run_dir) if isinstance(e, StepCommitted) and e.step >= 3)
        stopped = unanswered.model  # a sim drafter's model is named after it

        procs[stopped].send_signal(signal.SIGTERM)
        assert procs[stopped].wait(timeout=50) == 0
        log = (tmp_path / f"{stopped}.log").read_text()
        assert f"commit of step {unanswered.step} unanswered and asked to stop" in log, log[-3000:]
        assert f"checkpoint at step {unanswered.step - 1} saved, but not acknowledged" in log, log[-3000:]

        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher2.log")
        assert procs["dispatcher"].wait(timeout=240) == 0, (tmp_path / "dispatcher2.log").read_text()[-3000:]
        for name, proc in procs.items():
            if name not in ("dispatcher", stopped):
                assert proc.wait(timeout=60) == 0, name
    finally:
        for proc in procs.values():
            kill_tree(proc)
    (rolled,) = [e for e in read_journal(run_dir) if isinstance(e, ModelRolledBack) and e.cause == "abandoned"]
    assert (rolled.model, rolled.step, rolled.jobs) == (stopped, unanswered.step - 1, len(unanswered.jobs))
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
