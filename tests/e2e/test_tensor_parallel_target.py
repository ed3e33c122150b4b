"""`hsd launch` with a tensor-parallel target group (tp_size 2, gloo on the CPU) beside a real
DFlash drafter: one target to the dispatcher, with its two ranks in stats, exactly once; and a rank
of the group SIGKILLed (or SIGSTOPped past target.tp_timeout_s) inside a forward: the job is given
back once, the group comes back as a whole, the run ends exactly once, nothing is left behind."""

from __future__ import annotations

import re

import psutil
import pytest

from common import faults
from common.dataplane.shm_arena import list_segments
from common.run.records.events import WorkerJoined
from common.run.records.journal import read_journal
from common.wire.client import run_id_for
from dflash_run import tiny_run_args
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd, wait_for, wait_for_stats

GROUP = ("target.tp_size=2", "dispatcher.worker_timeout_s=20")
STOPPED_PAST_S = 6  # target.tp_timeout_s of the SIGSTOP case: short, yet far above a loaded host's collective


def _group_ranks(snapshot: dict) -> list[dict] | None:
    targets = [w for w in snapshot["workers"] if w["role"] == "target"]
    if len(targets) == 1 and len(targets[0].get("tp_ranks") or []) == 2:
        return targets[0]["tp_ranks"]
    return None


def _launch(tmp_path, run_dir, *, fault: str | None, monkeypatch) -> tuple[list[int], str]:
    """Run to the end; return every pid the target groups had and the log."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if fault:
        monkeypatch.setenv(faults.ENV, fault)
    timeout = (f"target.tp_timeout_s={STOPPED_PAST_S}",) if fault and "stop" in fault else ()
    args = tiny_run_args(tmp_path, run_dir, num_samples=16, extra=(*GROUP, *timeout))
    log_path = tmp_path / f"{run_dir.name}.log"
    proc = start_hsd("launch", *args, log_path=log_path)
    try:
        if not fault:  # the one group lives the whole run: stats show it as one target of two ranks
            ranks = wait_for_stats(run_dir, _group_ranks, timeout=60, what="one target with two ranks in stats")
            assert [r["rank"] for r in ranks] == [0, 1]
        assert proc.wait(timeout=150) == 0, log_path.read_text()[-4000:]
    finally:
        kill_tree(proc)
    log = log_path.read_text()
    return _incarnations(run_dir, log), log


def _incarnations(run_dir, log: str) -> list[int]:
    """Every pid of every incarnation of the target group, each incarnation once: rank 0 as the
    journal saw it join, the other ranks as rank 0 logged them. (A lost group's incarnation may live
    a fraction of a second, too short to be seen by asking stats.)"""
    leaders = [e.pid for e in read_journal(run_dir, only=(WorkerJoined,)) if e.role == "target"]
    others = [int(p) for found in re.findall(r"ranks 1\.\.1 are pids \[([0-9, ]+)\]", log) for p in found.split(",")]
    assert len(leaders) == len(others) and len(set(leaders + others)) == 2 * len(leaders), (leaders, others)
    return sorted(leaders + others)


def _nothing_left(run_dir, pids: list[int]) -> None:
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in pids), timeout=10, what="every rank gone")
    assert not list_segments(run_id_for(run_dir)), "shared memory left behind"


def test_a_tp2_target_group_is_one_target_and_trains_exactly_once(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    pids, log = _launch(tmp_path, run_dir, fault=None, monkeypatch=monkeypatch)
    assert len(pids) == 2  # one incarnation
    assert "run complete: every epoch committed" in log
    r = report(run_dir)
    assert r["finished"]
    assert_exactly_once(r)
    assert not r["given_back"]
    _nothing_left(run_dir, pids)


@pytest.mark.parametrize("signal_name", ["kill", "stop"])
def test_a_lost_rank_restarts_the_group_and_its_job_is_redone_once(signal_name, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    pids, log = _launch(tmp_path, run_dir, fault=f"target_rank_fault={signal_name}:1@2", monkeypatch=monkeypatch)
    assert len(pids) == 4  # the group lost, and the group that came back as a whole (two new ranks)
    assert f"target rank 1: SIG{signal_name.upper()} inside the forward of its job #2" in log
    assert "this incarnation of the group ends" in log
    assert "target-0 exited with code 6: restart 1/" in log
    r = report(run_dir)
    assert r["finished"]
    assert_exactly_once(r)
    # The job in flight went back once (its slot never published); a job granted ahead (prefetched, not
    # started) may go back as its worker leaves.
    assert r["given_back"]["target_failed"] == 1 and r["given_back"].get("left", 0) <= 1
    assert set(r["given_back"]) <= {"target_failed", "left"}
    _nothing_left(run_dir, pids)
