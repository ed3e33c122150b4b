"""An elastic group of real DFlash drafters (gloo) on a tiny target: ranks attach to a running
run, leave on SIGTERM and die by SIGKILL inside a step, and the group goes on from the live ranks'
own weights — never from a checkpoint, never rolling the ledger back.

The witnesses are outside the mechanism: every rank logs the CRC32 of its weights after every step
it applies (equal across ranks means bit-identical), and the models' trained-jobs record judges
exactly-once at the end.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import defaultdict

import psutil
import pytest

from common import faults
from common.dataplane.shm_arena import list_segments
from common.wire.client import run_id_for
from dflash_run import tiny_run_args
from common.run.records.events import ModelRolledBack, StepCommitted, WorkerLeft
from common.run.records.journal import read_journal
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd, stats, wait_for

CRC_LINE = re.compile(r"(drafter-\d+): weights crc32 ([0-9a-f]{8}) at step (\d+)")
FIRST_STEP = re.compile(r"(drafter-\d+): first step \d+ applied ([\d.]+)s after the process started")


def _cmdline(p: psutil.Process) -> list[str]:
    """A process's command line; empty for one that exited meanwhile (a schedule builder's child, say)."""
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def _group(s):
    return s.get("groups", {}).get("drafter") or {}


def _await_group(run_dir, condition, timeout, what):
    """The group as the stats show it, once ``condition(group)`` holds."""
    return wait_for(lambda: (lambda g: g if g and condition(g) else None)(_group(stats(run_dir) or {})), timeout,
                    what=what)


def _logs(run_dir) -> str:
    """Every drafter's log: those hsd launch started (run_dir/logs) and those the test attached (beside it)."""
    paths = [*(run_dir / "logs").glob("drafter-*.log"), *run_dir.parent.glob("drafter-*.log")]
    return "".join(p.read_text() for p in sorted(paths))


def _check_witnesses(run_dir):
    """Weights bit-identical on every rank after every step; steps only go up; exactly once."""
    crcs = defaultdict(set)
    for _, crc, step in CRC_LINE.findall(_logs(run_dir)):
        crcs[int(step)].add(crc)
    assert len(crcs) >= 10 and all(len(v) == 1 for v in crcs.values()), {s: v for s, v in crcs.items() if len(v) > 1}
    events = list(read_journal(run_dir))
    steps = [e.step for e in events if isinstance(e, StepCommitted)]
    assert steps == list(range(1, len(steps) + 1)), "a step was committed twice or rolled back"
    assert not [e for e in events if isinstance(e, ModelRolledBack) and e.jobs]
    r = report(run_dir)
    assert_exactly_once(r)
    assert not list_segments(run_id_for(run_dir)), "shared memory left behind"
    return events, r


def _frozen_mid_step(ranks, run_dir):
    """SIGSTOP the group's ranks while one of them holds a job of the step in flight (so the step
    cannot end while joiners arrive); None (and SIGCONT) when they happened to hold nothing."""
    for proc in ranks:
        os.kill(proc.pid, signal.SIGSTOP)
    s = stats(run_dir)
    if s and any(w["held"] for w in s["workers"] if w["role"] == "drafter"):
        return True
    for proc in ranks:
        os.kill(proc.pid, signal.SIGCONT)
    return None


@pytest.mark.timeout(600)
def test_drafters_attach_and_leave_a_running_run(tmp_path, monkeypatch):
    """1 drafter; a second attaches; then two attach at once (one version change, the 4-rank group
    steps right after); one of them leaves on SIGTERM once the 4 ranks have stepped twice, and the 3
    left commit their next step in the version that follows, no collective failing on the way."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(faults.ENV, "log_weight_checksums")
    run_dir = tmp_path / "run"
    # Long timeouts: the test holds the ranks (SIGSTOP) while two joiners start.
    args = tiny_run_args(tmp_path, run_dir, num_samples=32, epochs=40,
                         extra=("drafter.max_ranks=4", "drafter.checkpoint_every=1000",
                                "drafter.collective_timeout_s=120", "dispatcher.worker_timeout_s=90"))
    launch = start_hsd("launch", *args, log_path=tmp_path / "launch.log")
    procs = [launch]
    started = time.monotonic()
    try:
        v1 = _await_group(run_dir, lambda g: g["steps_since_change"] >= 3, 240, "the first steps")["version"]
        procs.append(start_hsd("drafter", *args, "--name", "drafter-1", log_path=tmp_path / "drafter-1.log"))
        v2 = _await_group(run_dir, lambda g: g["world_size"] == 2 and g["steps_since_change"] >= 2, 240,
                          "2 ranks stepping")["version"]
        launched_rank = psutil.Process(launch.pid).children(recursive=True)
        ranks = [procs[1]] + [p for p in launched_rank if _cmdline(p)[3:4] == ["drafter"]]
        wait_for(lambda: _frozen_mid_step(ranks, run_dir), 60, interval=0.05, what="the ranks frozen mid-step")
        try:
            for name in ("drafter-2", "drafter-3"):
                procs.append(start_hsd("drafter", *args, "--name", name, log_path=tmp_path / f"{name}.log"))
            _await_group(run_dir, lambda g: g["waiting"] == 2, 240, "two ranks waiting to join")
        finally:
            for proc in ranks:
                os.kill(proc.pid, signal.SIGCONT)
        g = _await_group(run_dir, lambda g: g["world_size"] == 4 and g["steps_since_change"] >= 1, 120,
                         "4 ranks stepping")
        assert g["version"] == v2 + 1  # both joiners came in at one step boundary
        _await_group(run_dir, lambda g: g["version"] == v2 + 1 and g["steps_since_change"] >= 2, 120,
                     "the 4 ranks' second step")
        leaver = next(w for w in stats(run_dir)["workers"] if w["name"] == "drafter-3")
        left_at = time.monotonic()
        procs[-1].send_signal(signal.SIGTERM)
        g = _await_group(run_dir, lambda g: g["world_size"] == 3 and g["steps_since_change"] >= 1, 240,
                         "3 ranks stepping after one left")
        next_step_s = time.monotonic() - left_at
        assert g["version"] == v2 + 2
        assert procs[-1].wait(timeout=60) == 0
        assert v2 == v1 + 1
        assert launch.wait(timeout=400) == 0, (tmp_path / "launch.log").read_text()[-4000:]
        for proc in procs[1:3]:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            kill_tree(proc)
    events, r = _check_witnesses(run_dir)
    assert r["finished"]
    joiner_start = dict(FIRST_STEP.findall(_logs(run_dir)))
    assert {"drafter-1", "drafter-2", "drafter-3"} <= set(joiner_start)
    ranks_per_step = defaultdict(set)
    for name, _, step in CRC_LINE.findall(_logs(run_dir)):
        ranks_per_step[int(step)].add(name)
    assert max(len(v) for v in ranks_per_step.values()) == 4  # four ranks applied the same steps, bit-identical
    # The one that left said so (deregister, not a silence the dispatcher had to time out), and the
    # 3 left went on without waiting out a collective with it: its version ended for them, none failed.
    assert [e.reason for e in events if isinstance(e, WorkerLeft) and e.w == leaver["id"]] == ["left"]
    failed = re.findall(rf"(drafter-\d+): membership {v2 + 1} failed: (.*)", _logs(run_dir))
    assert not failed, failed
    print(f"\njoiner start to first step: {joiner_start}; SIGTERM to the next step of the 3 left: "
          f"{next_step_s:.1f}s; run {time.monotonic() - started:.0f}s, "
          f"{len([e for e in events if isinstance(e, StepCommitted)])} steps")
