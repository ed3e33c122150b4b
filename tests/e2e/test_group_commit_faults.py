"""Group steps at their edges, end to end (sim targets, the linear drafter over gloo, ``hsd launch``).

- Rank 0 SIGKILLed with its commit durable and its outcome not yet sent (test fault ``committed``):
  the other ranks learn from the dispatcher that the step committed and apply it, so no committed
  step is rolled back or committed twice, and no survivor exits.
- The dispatcher exits with rank 0's commit durable and its reply unsent: every rank keeps the
  step, and the next dispatcher, which holds the commit, has them apply it as they register —
  whichever rank learns first that the dispatcher forgot it: rank 0 from its commit sent again, or
  its peer from a heartbeat refused while it waits for rank 0's outcome (forced here: rank 0 holds
  a pending outcome back, ``pending_outcome_delay_s``).
- ``drafter.step_balance=count`` on a group whose size does not divide the step (3 ranks, 4
  micro-batches a step: shares 2, 1, 1): every rank's job-exchange row has the group's width.
"""

from __future__ import annotations

import subprocess

from common import faults
from common.run.records.events import MembershipOpened, ModelRolledBack, StepCommitted
from common.run.records.journal import read_journal
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd, stats, wait_for


def _args(run_dir, *overrides: str) -> list[str]:
    return [f"run.dir={run_dir}", "target.sim=true", "target.count=2", "target.hidden_size=16",
            "target.num_capture_layers=2", "drafter.backend=linear", "drafter.accum_steps=2",
            "drafter.checkpoint_every=4", "drafter.collective_timeout_s=60", "drafter.max_restarts=3",
            "data.synthetic_samples=160", "dispatcher.heartbeat_s=0.2", "dispatcher.worker_timeout_s=5", *overrides]


def _steps_each_once(events):
    steps = [e.step for e in events if isinstance(e, StepCommitted)]
    assert steps == list(range(1, len(steps) + 1)), "a step was committed twice or rolled back"
    assert not [e for e in events if isinstance(e, ModelRolledBack) and e.jobs]


def test_rank0_killed_inside_its_commit_loses_no_step_and_no_survivor(run_dir, tmp_path, monkeypatch):
    # whichever rank is rank 0 when the group holds 2 ranks at step 3 or later dies there; the other,
    # rank 0 of the next pair, dies the same way once the first is back
    monkeypatch.setenv(faults.ENV, "kill_at=drafter-0@committed:3,kill_at=drafter-1@committed:3")
    launch = start_hsd("launch", *_args(run_dir, "drafter.count=2", "target.sim_cost_per_token=2e-5", "run.epochs=6"),
                       log_path=tmp_path / "launch.log")
    try:
        try:
            code = launch.wait(timeout=240)
        except subprocess.TimeoutExpired:  # say where it stands, from its own logs and stats
            code = f"still running: {stats(run_dir)}"
        assert code == 0, f"{code}\n{(tmp_path / 'launch.log').read_text()[-6000:]}"
    finally:
        kill_tree(launch)
    _steps_each_once(list(read_journal(run_dir)))  # the committed steps stay
    assert_exactly_once(report(run_dir))
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("drafter-*.log"))
    assert logs.count("SIGKILL at committed of step") == 2, logs[-3000:]
    assert logs.count("the dispatcher says it committed: applied") == 2, logs[-3000:]
    assert "StateTransferFailed" not in logs and "Traceback" not in logs
    launch_log = (tmp_path / "launch.log").read_text()
    assert launch_log.count("exited with code") == 2, launch_log[-3000:]  # the two kills, no survivor


def test_a_group_commit_whose_reply_died_with_the_dispatcher_is_applied(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "dispatcher_exit_before_commit_reply=3,pending_outcome_delay_s=2")
    args = _args(run_dir, "drafter.count=2", "target.count=1", "target.sim_cost_per_token=2e-5", "run.epochs=3")
    procs = {}
    try:
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher1.log")
        for name in ("target-0", "drafter-0", "drafter-1"):
            procs[name] = start_hsd(name.split("-")[0], *args, "--name", name, log_path=tmp_path / f"{name}.log")
        assert procs["dispatcher"].wait(timeout=180) == 9, (tmp_path / "dispatcher1.log").read_text()[-3000:]
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher2.log")
        assert procs["dispatcher"].wait(timeout=240) == 0, (tmp_path / "dispatcher2.log").read_text()[-3000:]
        for name in ("target-0", "drafter-0", "drafter-1"):
            assert procs[name].wait(timeout=60) == 0, name
    finally:
        for proc in procs.values():
            kill_tree(proc)
    _steps_each_once(list(read_journal(run_dir)))
    assert_exactly_once(report(run_dir))
    logs = "".join((tmp_path / f"drafter-{i}.log").read_text() for i in (0, 1))
    assert logs.count("sent to the last dispatcher, committed: applied") == 2, logs[-3000:]
    assert "took the state of step" not in logs, logs[-3000:]  # each rank kept the step: nothing to transfer


def test_count_balance_on_a_group_whose_size_does_not_divide_the_step(run_dir, tmp_path):
    # The group opens with drafter.count (2) ranks and the third joins it in the next version. The
    # targets start only once that 3-rank version is open, so the run cannot end before it, however
    # fast the host: every step is the 3-rank group's.
    args = _args(run_dir, "drafter.count=2", "drafter.max_ranks=3", "drafter.step_balance=count",
                 "target.sim_cost_per_token=2e-5", "run.epochs=2")
    procs = {}

    def three_rank_versions() -> set[int]:
        try:
            return {m.version for m in read_journal(run_dir, only=(MembershipOpened,)) if len(m.ranks) == 3}
        except FileNotFoundError:  # a segment renamed while it was read: look again
            return set()

    try:
        procs["dispatcher"] = start_hsd("dispatcher", *args, log_path=tmp_path / "dispatcher.log")
        for name in ("drafter-0", "drafter-1", "drafter-2"):
            procs[name] = start_hsd("drafter", *args, "--name", name, log_path=tmp_path / f"{name}.log")
        wait_for(three_rank_versions, timeout=180, what="a membership of 3 ranks")
        for name in ("target-0", "target-1"):
            procs[name] = start_hsd("target", *args, "--name", name, log_path=tmp_path / f"{name}.log")
        assert procs["dispatcher"].wait(timeout=300) == 0, (tmp_path / "dispatcher.log").read_text()[-4000:]
        for name, proc in procs.items():
            assert proc.wait(timeout=60) == 0, f"{name}: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
    finally:
        for proc in procs.values():
            kill_tree(proc)
    events = list(read_journal(run_dir))
    triples = three_rank_versions()
    steps = [e for e in events if isinstance(e, StepCommitted)]
    assert steps and all(e.membership in triples for e in steps), "a step was committed outside the 3-rank group"
    assert all(len(e.jobs) == 4 for e in steps[:-1])  # shares 2, 1, 1 of 4 (the last may be partial)
    _steps_each_once(events)
    assert_exactly_once(report(run_dir))
