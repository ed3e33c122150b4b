"""The worker loop against a real dispatcher: each worker holds its next job while computing one.

The dispatcher's own stats are the witness: a job it granted to a worker is listed under that
worker until reported, so a drafter seen holding two jobs at once asked for its next one before it
finished the current one, and kept it listed in its heartbeats (else it would have been given back).
"""

from __future__ import annotations

import signal

from hsd_testing import kill_tree, report, sim_args, start_hsd, stats, wait_for


def test_targets_and_drafters_hold_their_next_job_while_computing(run_dir, tmp_path):
    # A slow drafter (about 0.4 s per micro-batch) behind a fast target: the pool fills, so the drafter's
    # prefetched get_hs is granted at once while it computes.
    args = sim_args(run_dir, "run.epochs=1", "data.synthetic_samples=150", "drafter.sim_cost_per_token=5e-5",
                    "target.sim_cost_per_token=2e-5", "pool.min_ready=2", "drafter.accum_steps=4")
    procs = [start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher.log")]
    try:
        for name in ("target-0", "drafter-0"):
            procs.append(start_hsd(name.split("-")[0], *args, "--name", name, log_path=tmp_path / f"{name}.log"))

        def holding(role: str, count: int):
            s = stats(run_dir)
            return s and any(w["role"] == role and len(w["held"]) >= count for w in s["workers"])
        wait_for(lambda: holding("target", 2), 120, what="a target holding its prefetched job")
        wait_for(lambda: holding("drafter", 2), 120, what="a drafter holding its prefetched job")
        wait_for(lambda: (lambda s: s and s["steps"] >= 1)(stats(run_dir)), 120, what="a committed step")
        # Heartbeats listed every job the workers held: the dispatcher never had to take one back.
        assert stats(run_dir)["given_back"].get("not_held", 0) == 0
        for proc in procs[1:]:
            proc.send_signal(signal.SIGTERM)  # a clean stop: after the current job, through deregister
        for proc in procs[1:]:
            assert proc.wait(timeout=30) == 0
        assert stats(run_dir)["workers"] == []
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == 0
    finally:
        for proc in procs:
            kill_tree(proc)
    r = report(run_dir)
    assert r["duplicates"] == 0 and r["committed"] > 0
