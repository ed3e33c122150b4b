"""A rank of a 2-rank drafter group paused (SIGSTOP) under `hsd launch`, past the dispatcher's
dead-worker timeout and past its own reconnect window, then resumed (SIGCONT).

A stopped rank closes no socket, so gloo alone would keep the survivor in the step's collective
for the whole ``drafter.collective_timeout_s`` (60 s here). The survivor learns from its heartbeat's
answer that the dispatcher ended the version and goes on alone at once; the resumed rank, which
the dispatcher declared dead, registers again (never "no dispatcher") and rejoins as a new member;
the models' own witness shows every job trained exactly once.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from common import faults
from common.run.records.events import MembershipOpened
from common.run.records.journal import read_journal
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd, stats, wait_for

WORKER_TIMEOUT_S = 2.0
RECONNECT_S = 3.0
STOPPED_S = 6.0  # past the dead-worker timeout and the reconnect window both


def _args(run_dir) -> list[str]:
    return [f"run.dir={run_dir}", "target.sim=true", "target.count=2", "target.hidden_size=16",
            "target.num_capture_layers=2", "target.sim_cost_per_token=2e-5", "drafter.backend=linear",
            "drafter.count=2", "drafter.accum_steps=2", "drafter.checkpoint_every=4",
            "drafter.collective_timeout_s=60", "drafter.max_restarts=0", "data.synthetic_samples=160",
            "run.epochs=6", "dispatcher.heartbeat_s=0.2", f"dispatcher.worker_timeout_s={WORKER_TIMEOUT_S}",
            f"dispatcher.reconnect_s={RECONNECT_S}"]


def _step(s: dict) -> int:
    return s["models"]["drafter"]["step"] if "drafter" in s["models"] else 0


def _rejoined(run_dir, name: str) -> str:
    """The run trained every job once, and ``name`` (declared dead while stopped) was told so once it
    woke, registered again and came back as a new member: a 2-rank version opened after the
    survivor's version alone. Its log."""
    assert_exactly_once(report(run_dir))
    log_text = (run_dir / "logs" / f"{name}.log").read_text()
    assert "registering again" in log_text and log_text.count("registered as") == 2, log_text[-3000:]
    memberships = [e for e in read_journal(run_dir) if isinstance(e, MembershipOpened)]
    alone = next(m.version for m in memberships if len(m.ranks) == 1)
    assert any(len(m.ranks) == 2 and m.version > alone for m in memberships), memberships
    return log_text


def test_a_stopped_rank_holds_its_group_no_longer_than_its_death_and_rejoins_when_resumed(run_dir, tmp_path):
    launch = start_hsd("launch", *_args(run_dir), log_path=tmp_path / "launch.log")
    stopped = None
    try:
        s = wait_for(lambda: (lambda s: s is not None and s["groups"].get("drafter", {}).get("world_size") == 2
                              and _step(s) >= 3 and s)(stats(run_dir)), 180, what="two ranks training together")
        pid = next(w["pid"] for w in s["workers"] if w["name"] == "drafter-1")
        os.kill(pid, signal.SIGSTOP)
        stopped, step_at_stop = time.monotonic(), _step(s)
        # the survivor commits alone after the dispatcher's verdict, not after collective_timeout_s
        wait_for(lambda: (lambda s: s is not None and s["groups"]["drafter"]["world_size"] == 1
                          and _step(s) > step_at_stop + 1)(stats(run_dir)), 30, interval=0.05,
                 what="the survivor's commit alone")
        survivor_s = time.monotonic() - stopped
        assert survivor_s < WORKER_TIMEOUT_S + 8, survivor_s
        wait_for(lambda: time.monotonic() - stopped >= STOPPED_S, STOPPED_S + 1, what="the pause")
        os.kill(pid, signal.SIGCONT)
        stopped = None
        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    finally:
        if stopped is not None:
            os.kill(pid, signal.SIGCONT)
        kill_tree(launch)
    log_text = _rejoined(run_dir, "drafter-1")
    assert "DispatcherGone" not in log_text and "no dispatcher" not in log_text, log_text[-3000:]
    launch_log = (tmp_path / "launch.log").read_text()
    assert "exited with code" not in launch_log, launch_log[-3000:]  # the paused rank never gave up


def test_a_rank0_paused_before_its_commit_is_told_it_was_forgotten_and_rejoins_at_once(run_dir, tmp_path,
                                                                                        monkeypatch):
    """Rank 0 stops (SIGSTOP) with the step's gradients summed, before it sends the commit; declared
    dead, the survivor goes on alone. Resumed, its commit is answered "unknown worker": it keeps the
    step pending and registers again at once — it does not wait in the outcome's broadcast for a peer
    that has left the version (which would hold it until that peer's process ends with the run)."""
    monkeypatch.setenv(faults.ENV, f"stop_at={faults.ANY_DRAFTER}@commit:3")
    launch = start_hsd("launch", *_args(run_dir), log_path=tmp_path / "launch.log")
    stopped = None
    try:
        def a_stopped_drafter():
            s = stats(run_dir)
            for w in (s or {}).get("workers", []):
                if w["role"] == "drafter" and psutil.pid_exists(w["pid"]) and \
                        psutil.Process(w["pid"]).status() == psutil.STATUS_STOPPED:
                    return w
            return None
        victim = wait_for(a_stopped_drafter, 180, interval=0.05, what="rank 0 stopped before its commit")
        stopped = victim["pid"]
        wait_for(lambda: (lambda s: s is not None and s["groups"]["drafter"]["world_size"] == 1
                          and s["groups"]["drafter"]["steps_since_change"] >= 1)(stats(run_dir)), 60,
                 what="the survivor committing alone")
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        kill_tree(launch)
    log_text = _rejoined(run_dir, victim["name"])
    assert "SIGSTOP at commit" in log_text, log_text[-3000:]
