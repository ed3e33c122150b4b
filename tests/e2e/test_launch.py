"""`hsd launch` end to end: sim workers, real processes, sockets, shared memory and journal."""

from __future__ import annotations

import json
import os
import signal

import psutil

from common import faults
from common.dataplane.shm_arena import list_segments
from common.run.records.events import JobGivenBack, JobReady, WorkerJoined
from common.run.records.journal import read_journal
from common.wire.client import run_id_for
from hsd_testing import assert_exactly_once, hsd, report, running_hsd, sim_args, stats, wait_for, wait_for_stats


def test_launch_5_targets_3_drafters_two_epochs_exactly_once(run_dir):
    args = sim_args(run_dir, "run.epochs=2", "target.count=5", "drafter.count=3", "drafter.accum_steps=4",
                    "pool.slots=16", "pool.min_ready=6")
    proc = hsd("launch", *args, timeout=300)
    assert "run complete: every epoch committed" in proc.stderr
    r = report(run_dir)
    assert r["finished"] and r["epochs"] == 2
    assert r["jobs_total"] > 100
    assert_exactly_once(r)
    assert r["step_mix"] >= 0.99
    assert r["prefix_deviation"]["consumed"] <= 3
    assert r["prefix_deviation"]["schedule"] <= 2
    # every target and drafter took part, and every slot the drafters read was verified
    log = (run_dir / "logs")
    assert len(list(log.glob("target-*.log"))) == 5 and len(list(log.glob("drafter-*.log"))) == 3
    assert "exited with code" not in proc.stdout + proc.stderr  # no worker crashed or was restarted


def test_sigkilled_target_job_is_extracted_again(run_dir, tmp_path, monkeypatch):
    # The first target to take a job stops itself before extracting it: the job it is killed
    # holding is known, whatever the machine's speed.
    held_at = tmp_path / "stopped-in-job.json"
    monkeypatch.setenv(faults.ENV, f"target_stop_in_job={held_at}")
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=2", "target.max_restarts=2",
                    "dispatcher.worker_timeout_s=120")  # it dies by the SIGKILL, not by its silence while stopped
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        held = wait_for(lambda: held_at.exists() and json.loads(held_at.read_text()), 120,
                        what="a target stopped inside a job")
        wait_for(lambda: psutil.Process(held["pid"]).status() == psutil.STATUS_STOPPED, 60, interval=0.05,
                 what="the target stopped")
        victim = next(w for w in stats(run_dir)["workers"] if w["pid"] == held["pid"])
        assert held["job_id"] in victim["held"]
        os.kill(victim["pid"], signal.SIGKILL)
        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    r = report(run_dir)
    assert_exactly_once(r)
    assert r["given_back"].get("dead", 0) >= 1
    events = list(read_journal(run_dir))
    given_back = {e.job for e in events if isinstance(e, JobGivenBack) and e.was == "extracting"
                  and e.w == victim["id"]}
    assert held["job_id"] in given_back
    for job in given_back:
        back_at = next(i for i, e in enumerate(events) if isinstance(e, JobGivenBack) and e.job == job)
        assert any(isinstance(e, JobReady) and e.job == job for e in events[back_at:]), "job was not extracted again"
    assert "restart 1/2" in (tmp_path / "launch.log").read_text()


def test_stats_against_running_launch(run_dir, tmp_path):
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=1", "target.sim_cost_per_token=1e-4")
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        s = wait_for_stats(run_dir, lambda s: s if len(s["workers"]) == 3 else None, 120,
                           what="3 registered workers")
        for key in ("epochs", "jobs_by_state", "q_hsb", "workers", "pool", "transport", "epochs_total"):
            assert key in s
        assert set(s["jobs_by_state"]) == {"pending", "extracting", "ready", "training", "consumed", "committed"}
        worker = s["workers"][0]
        for key in ("role", "state", "tokens_per_s", "idle_ratio", "heartbeat_age_s"):
            assert key in worker
        assert {w["state"] for w in s["workers"]} <= {"busy", "idle", "starved", "blocked"}
        assert s["transport"]["pool_bytes"] == s["transport"]["slot_bytes"] * s["transport"]["num_slots"]
        assert json.loads(hsd("stats", "--run-dir", str(run_dir), "--json").stdout)["run_dir"] == str(run_dir)
        text = hsd("stats", "--run-dir", str(run_dir)).stdout
        assert "q_hsb" in text and "target-0" in text and "epoch 1/1" in text
        assert launch.wait(timeout=240) == 0
    assert hsd("stats", "--run-dir", str(run_dir), check=False).returncode == 1  # nobody answers any more


def test_sigkill_everything_then_relaunch_resumes_and_sweeps_shm(run_dir, tmp_path):
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=2", "target.sim_cost_per_token=5e-5")
    with running_hsd("launch", *args, log_path=tmp_path / "launch1.log"):
        wait_for_stats(run_dir, lambda s: s["steps"] >= 5, 120, what="5 committed steps")
    run_id = run_id_for(run_dir)
    assert list_segments(run_id), "the killed run should have left its arena behind"
    assert hsd("cleanup", "--run-dir", str(run_dir)).returncode == 0
    assert not list_segments(run_id)
    # Kill once more and let the relaunch do the sweeping itself, then finish the epoch exactly once.
    with running_hsd("launch", *args, log_path=tmp_path / "launch2.log"):
        wait_for_stats(run_dir, lambda s: s["steps"] >= 10, 120, what="10 committed steps")
    stale = list_segments(run_id)
    assert stale
    with open(run_dir / "journal.jsonl", "ab") as journal:   # a power cut in the middle of a record
        journal.write(b'0badc0de {"ev":"rollback","model":"drafter-0","st')
    proc = hsd("launch", *args, timeout=240)
    assert "run complete: every epoch committed" in proc.stderr
    assert not any(s.name == stale[0].name for s in list_segments(run_id))
    r = report(run_dir)
    assert r["restarts"] == 2
    joined = [e.w for e in read_journal(run_dir, only=(WorkerJoined,))]
    assert len(joined) == len(set(joined)), "a worker id was handed out twice"
    assert_exactly_once(r)


def test_launch_2_targets_2_drafters_verifies_every_slot(run_dir):
    proc = hsd("launch", *sim_args(run_dir, "run.epochs=2", "target.count=2", "drafter.count=2"), timeout=300)
    assert "run complete: every epoch committed" in proc.stderr
    r = report(run_dir)
    assert_exactly_once(r)
    # each sim drafter checked every slot it read against the pattern its target wrote
    assert r["slots_verified"] == r["jobs_total"]
    assert "SlotIntegrityError" not in proc.stdout and "StaleSlotError" not in proc.stdout


def test_ctrl_c_stops_the_run_cleanly_and_a_relaunch_finishes_it(run_dir, tmp_path):
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=1", "target.sim_cost_per_token=5e-5")
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        wait_for_stats(run_dir, lambda s: s["steps"] >= 3, 120, what="3 committed steps")
        os.kill(launch.pid, signal.SIGINT)
        assert launch.wait(timeout=60) == 130
    assert not list_segments(run_id_for(run_dir)), "a clean stop unlinks the arena"
    r = report(run_dir)
    assert not r["finished"] and r["lost"] == 0 and r["uncommitted"] > 0 and r["duplicates"] == 0
    hsd("launch", *args, timeout=240)
    r = report(run_dir)
    assert r["finished"] and (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)


def test_launch_fails_when_the_dispatcher_is_stopped_before_the_end(run_dir, tmp_path):
    args = sim_args(run_dir, "run.epochs=1", "target.count=1", "drafter.count=1", "target.sim_cost_per_token=5e-5")
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        s = wait_for_stats(run_dir, lambda s: s if s["steps"] >= 2 else None, 120, what="2 steps")
        os.kill(s["pid"], signal.SIGTERM)  # the dispatcher itself, from outside the launcher
        assert launch.wait(timeout=60) == 1
    assert "stopped before the run was complete" in (tmp_path / "launch.log").read_text()


def test_launch_over_loopback_tcp(run_dir):
    import socket
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    proc = hsd("launch", *sim_args(run_dir, "run.epochs=1", "target.count=1", "drafter.count=1",
                                   f"dispatcher.endpoint=tcp://127.0.0.1:{ports[0]}",
                                   f"dispatcher.stats_endpoint=tcp://127.0.0.1:{ports[1]}"), timeout=240)
    assert "run complete: every epoch committed" in proc.stderr
    assert_exactly_once(report(run_dir))
