"""A drafter cut off before its first checkpoint (SIGSTOP, as a partition or a suspended host looks to
the dispatcher): the run ends without it, and when it wakes it saves nothing the others retrained."""

from __future__ import annotations

import os
import signal

from common.run.records.rundir import STATE_FILE
from hsd_testing import assert_exactly_once, report, running_hsd, sim_args, stats, wait_for, wait_for_stats


def test_a_drafter_cut_off_before_its_first_checkpoint_ends_the_run_and_saves_nothing_stale(run_dir, tmp_path):
    """The order is forced: the drafter is stopped past two steps with no checkpoint; the dispatcher
    declares it dead, gives its model up (back to step 0) after dispatcher.abandoned_model_s, the
    other drafter trains every job and the dispatcher exits done; only then does the stopped drafter
    wake, to the launcher's SIGTERM. Before, it saved the steps it had applied on its way out, and
    the witness counted their jobs twice (12 of 109 in a 75 s partition)."""
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=2", "drafter.checkpoint_every=1000",
                    "dispatcher.worker_timeout_s=1", "dispatcher.abandoned_model_s=2")
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        def a_drafter_past_two_steps_without_a_checkpoint(s):
            for model, state in (s.get("models") or {}).items():
                worker = next((w for w in s["workers"] if w["name"] == model), None)
                if worker is not None and state["step"] >= 2 and state["checkpoint"] == 0:
                    return worker
            return None
        victim = wait_for_stats(run_dir, a_drafter_past_two_steps_without_a_checkpoint, 120, interval=0.05,
                                what="a drafter two steps in, no checkpoint")
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            wait_for(lambda: stats(run_dir) is None and not (run_dir / STATE_FILE).exists()
                     and "all 1 epoch(s) committed" in (tmp_path / "launch.log").read_text(), 180,
                     what="the run done without the stopped drafter")
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        assert launch.wait(timeout=120) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert_exactly_once(report(run_dir))
    log = (tmp_path / "launch.log").read_text()
    assert f"model {victim['name']}: no drafter has trained it" in log
    assert f"{victim['name']}: step " in log and "not saved: the dispatcher went unheard" in log
