"""Helpers for tests that run real `hsd` processes on ipc:// endpoints in a temporary run dir."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil



def hsd(*args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dispatcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"hsd {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def start_hsd(*args: str, log_path: Path) -> subprocess.Popen:
    """Start an `hsd` command in its own process group (so a test can kill the whole tree)."""
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "dispatcher.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def report(run_dir: Path) -> dict:
    return json.loads(hsd("report", "--run-dir", str(run_dir), "--json").stdout)


def stats(run_dir: Path) -> dict | None:
    """The dispatcher's stats snapshot, or None while none answers (asked in-process: fast)."""
    from common.client import DispatcherUnavailable
    from dispatcher.stats_view import fetch_stats, resolve_stats_endpoint
    if not (run_dir / "config.yaml").exists():
        return None
    try:
        return fetch_stats(*resolve_stats_endpoint(None, str(run_dir)), timeout_s=1.0)
    except DispatcherUnavailable:
        return None


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every descendant, wherever their process groups are."""
    try:
        parent = psutil.Process(proc.pid)
        victims = [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def sim_args(run_dir: Path, *overrides: str) -> list[str]:
    """A small sim run: fast on a 2-core machine, still many jobs across 6 buckets."""
    return [f"run.dir={run_dir}", "target.sim=true", "drafter.sim=true", "data.synthetic_samples=400",
            "dispatcher.heartbeat_s=0.2", "dispatcher.worker_timeout_s=3", *overrides]


def child_message(queue, child, timeout: float = 120.0):
    """A spawned child's next message, failing fast (not after the timeout) if the child died."""
    from queue import Empty
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.2)
        except Empty:
            assert child.is_alive(), f"child exited with {child.exitcode} before answering"
    raise AssertionError("child did not answer in time")
