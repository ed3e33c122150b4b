"""Helpers for tests that run real `hsd` processes on ipc:// endpoints in a temporary run dir."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil


def hsd(*args: str, timeout: float = 240, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hsd.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"hsd {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def start_hsd(*args: str, log_path: Path) -> subprocess.Popen:
    """Start an `hsd` command in its own process group (so a test can kill the whole tree)."""
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "hsd.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@contextlib.contextmanager
def running_hsd(*args: str, log_path: Path) -> Iterator[subprocess.Popen]:
    """:func:`start_hsd` for the block; its whole process tree is killed when the block ends, however it ends."""
    proc = start_hsd(*args, log_path=log_path)
    try:
        yield proc
    finally:
        kill_tree(proc)


def report(run_dir: Path) -> dict:
    return json.loads(hsd("report", "--run-dir", str(run_dir), "--json").stdout)


def assert_exactly_once(r: dict) -> None:
    """A finished run's report: the ledger committed every job once and lost none, and the models'
    own witness (the jobs their checkpoints say they trained) agrees."""
    assert (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
    assert (r["witness_duplicates"], r["witness_missing"]) == (0, 0)   # judged by the models themselves


def stats(run_dir: Path) -> dict | None:
    """The dispatcher's stats snapshot as ``hsd stats --json`` prints it, or None while none answers
    (asked in-process: fast)."""
    from common.wire.stats_snapshot import to_json_object
    from ops.stats_view import run_stats_or_none
    snapshot = run_stats_or_none(run_dir)
    return to_json_object(snapshot) if snapshot is not None else None


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_for_stats(run_dir: Path, predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    """The first true ``predicate(snapshot)`` of the dispatcher's stats; a moment when no dispatcher
    answers (not started yet, restarting) counts as false."""
    return wait_for(lambda: (lambda s: s is not None and predicate(s))(stats(run_dir)), timeout, interval, what)


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


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def curve_args(keys: Path, control_port: int, stats_port: int, *, allowed: tuple[str, ...] = ("node-a",),
               client: str = "node-a") -> list[str]:
    """Overrides for a control plane over loopback TCP with CURVE, keys made by `hsd keys --out keys`."""
    return [f"dispatcher.endpoint=tcp://127.0.0.1:{control_port}",
            f"dispatcher.stats_endpoint=tcp://127.0.0.1:{stats_port}",
            f"curve.server_public_key={keys / 'dispatcher.key'}",
            f"curve.server_secret_key={keys / 'dispatcher.key_secret'}",
            f"curve.allowed_client_keys=[{','.join(str(keys / f'{name}.key') for name in allowed)}]",
            f"curve.client_secret_key={keys / f'{client}.key_secret'}"]


@contextlib.contextmanager
def started(processes: list) -> Iterator[list]:
    """Start every (multiprocessing) process; on the way out kill those still running and join all."""
    for proc in processes:
        proc.start()
    try:
        yield processes
    finally:
        for proc in processes:
            if proc.is_alive():
                proc.kill()
            proc.join()


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


# -- a command in a session of its own --------------------------------------------------------------
# Every process such a command starts (dispatcher, workers, multiprocessing helpers) carries its
# session id, whatever its process group, so anything still holding the id afterwards is an orphan.

def session_pids(sid: int) -> set[int]:
    pids = set()
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                pids.add(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def kill_session(sid: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@dataclass
class SessionRun:
    sid: int
    returncode: int
    stdout: str
    stderr: str
    seen: set[int]  # every pid seen in the session while the command ran


def run_hsd_in_session(*args: str, timeout: float) -> SessionRun:
    """Run an `hsd` command to its end in a session of its own (output captured), noting the
    processes of the session as it goes; past ``timeout`` the whole session is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "hsd.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        seen |= session_pids(proc.pid)
        try:
            out, err = proc.communicate(timeout=0.1)
            return SessionRun(proc.pid, proc.returncode, out, err, seen)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                kill_session(proc.pid)  # the whole command, not just its parent
                proc.wait()
                raise


def assert_session_ended(sid: int, *, grace_s: float = 0.0) -> None:
    """No process of the session is left (after up to ``grace_s`` for stragglers to exit); any left is killed."""
    leftovers = session_pids(sid)
    wait_until = time.monotonic() + grace_s
    while leftovers and time.monotonic() < wait_until:
        time.sleep(0.1)
        leftovers = session_pids(sid)
    kill_session(sid)
    assert not leftovers, f"processes left running: {leftovers}"
