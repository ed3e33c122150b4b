"""Processes started one by one: attach a drafter while training runs, restart a killed dispatcher."""

from __future__ import annotations

import os
import signal

from hsd_testing import kill_tree, report, start_hsd, stats, wait_for


def test_late_drafter_and_dispatcher_restart_keep_exactly_once(run_dir, tmp_path):
    args = ["--config", str(tmp_path / "run.yaml")]
    (tmp_path / "run.yaml").write_text("\n".join([
        "run: {epochs: 1}", "data: {synthetic_samples: 400}", "target: {sim: true, sim_cost_per_token: 4.0e-5}",
        # a worker stopped below must outlive its silence: it is never meant to be declared dead here
        "drafter: {sim: true}", "dispatcher: {heartbeat_s: 0.2, worker_timeout_s: 240}"]) + "\n")
    overrides = [f"run.dir={run_dir}"]
    procs = []
    try:
        dispatcher = start_hsd("dispatcher", *args, *overrides, log_path=tmp_path / "dispatcher1.log")
        procs.append(dispatcher)
        for name in ("target-0", "target-1", "drafter-0"):
            role = name.split("-")[0]
            procs.append(start_hsd(role, *args, *overrides, "--name", name, log_path=tmp_path / f"{name}.log"))
        wait_for(lambda: (lambda s: s and s["steps"] >= 3)(stats(run_dir)), 120, what="3 committed steps")

        # The run must not end before the late drafter takes part, however long its start takes: the
        # targets and drafter-0 are stopped until it has registered, and drafter-0 until it has work.
        first = procs[1:4]
        for proc in first:
            os.kill(proc.pid, signal.SIGSTOP)
        late = start_hsd("drafter", *args, *overrides, "--name", "drafter-late", log_path=tmp_path / "late.log")
        procs.append(late)
        late_worker = lambda s: next((w for w in (s or {}).get("workers", ()) if w["name"] == "drafter-late"), None)
        wait_for(lambda: late_worker(stats(run_dir)), 120, what="the late drafter to register")
        for proc in first[:2]:
            os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: (late_worker(stats(run_dir)) or {}).get("jobs", 0) > 0, 120,
                 what="the late drafter to commit work")
        os.kill(first[2].pid, signal.SIGCONT)

        os.kill(dispatcher.pid, signal.SIGKILL)
        dispatcher.wait(timeout=10)
        dispatcher = start_hsd("dispatcher", *args, *overrides, log_path=tmp_path / "dispatcher2.log")
        procs.append(dispatcher)
        wait_for(lambda: (lambda s: s and len(s["workers"]) == 4)(stats(run_dir)), 120,
                 what="all four workers to register with the new dispatcher")

        assert dispatcher.wait(timeout=240) == 0, (tmp_path / "dispatcher2.log").read_text()[-3000:]
        for proc in procs[1:]:
            if proc is not dispatcher:
                assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            kill_tree(proc)
    r = report(run_dir)
    assert r["restarts"] == 1
    assert (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
    assert (r["witness_duplicates"], r["witness_missing"]) == (0, 0)   # judged by the models themselves
    assert r["slots_verified"] >= r["jobs_total"]
