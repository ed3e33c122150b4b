"""``hsd launch``: the dispatcher plus every configured worker of one node, as separate processes.

Children run in their own sessions (a terminal's Ctrl-C reaches the launcher alone, which then
stops workers before the dispatcher) and die with the launcher (PR_SET_PDEATHSIG). Their output is
prefixed by role and also kept in ``<run.dir>/logs/<name>.log``. A target of ``target.tp_size`` k is
one child, rank 0 of its group, given its k GPUs (``target.gpus`` k at a time); it starts its other
ranks itself, so a lost rank restarts the whole group. A crashed worker is restarted up
to ``max_restarts`` times, but not one that exits with ``EXIT_UNUSABLE`` (it cannot work in this
run as configured and would fail the same way again); the run ends when the dispatcher exits, which it does once the last
epoch is committed. The data is validated whole before anything starts: a bad dataset is refused
(exit 2, naming the file and the first bad sample) with no process started.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.child_process import die_with_parent
from common.run.config import Config, write_resolved
from common.run.durable import STORAGE_FAILED_EXIT_CODE
from common.run.records.events import DispatcherStopped
from common.run.records.journal import JournalCorrupt, JournalDamaged, last_event
from common.run.records.lengths import load_lengths
from common.run.records.rundir import check_free_space, read_state_file
from common.run.tensor_parallel import check_tensor_parallel
from common.worker.runtime import CALL_TIMEOUT_S, EXIT_UNUSABLE
from ops.report import build_report, format_report

log = logging.getLogger("hsd.launch")

READY_TIMEOUT_S = 120.0
# A worker asked to stop may be waiting on a call to a dispatcher that no longer answers (CALL_TIMEOUT_S)
# before it saves its state: its grace is longer than that, with room for the save.
STOP_GRACE_S = CALL_TIMEOUT_S + 20.0

def _run_completed(run_dir: Path) -> bool:
    """Whether the dispatcher's last stop, as journaled, came after every epoch was committed."""
    try:
        stop = last_event(run_dir, DispatcherStopped)
    except (JournalDamaged, JournalCorrupt):  # the dispatcher's own start says what is wrong with it
        return False
    return stop is not None and stop.done


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    max_restarts: int
    process: subprocess.Popen | None = None
    restarts: int = 0
    finished: bool = False
    pump: threading.Thread | None = field(default=None, repr=False)


class Launcher:
    def __init__(self, config: Config):
        self.config = config
        self.run_dir = config.run_dir
        self.log_dir = self.run_dir / "logs"
        self._stop = threading.Event()
        self._print_lock = threading.Lock()
        self.children: list[Child] = []

    # -- processes ----------------------------------------------------------------------------
    def _command(self, *args: str) -> list[str]:
        # The resolved config leaves nodes.name empty (it is node-local): this node's children get it here.
        node = [f"nodes.name={self.config.nodes.name}"] if self.config.nodes.name else []
        return [sys.executable, "-m", "hsd.cli", *args, *node]

    def _plan(self, config_path: Path) -> list[Child]:
        base_env = dict(os.environ, PYTHONUNBUFFERED="1")
        children = []
        for role in ("target", "drafter"):
            section = getattr(self.config, role)
            per_worker = self.config.target.tp_size if role == "target" and not section.sim else 1
            for i in range(section.count):
                env = dict(base_env)
                if section.gpus:  # a target group's ranks: cuda:0..k-1 inside it
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, section.gpus[i * per_worker:(i + 1) * per_worker]))
                name = f"{role}-{i}"
                argv = self._command(role, "--config", str(config_path), "--name", name)
                children.append(Child(name, role, argv, env, section.max_restarts))
        return children

    def _start(self, child: Child) -> None:
        log_file = open(self.log_dir / f"{child.name}.log", "ab")
        child.process = subprocess.Popen(child.argv, env=child.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent, cwd=os.getcwd())
        child.pump = threading.Thread(target=self._pump, args=(child.name, child.process, log_file), daemon=True)
        child.pump.start()

    def _pump(self, name: str, process: subprocess.Popen, log_file) -> None:
        prefix = f"{name:>12} | ".encode()
        with log_file:
            for line in process.stdout:
                log_file.write(line)
                with self._print_lock:
                    sys.stdout.buffer.write(prefix + line)
                    sys.stdout.buffer.flush()

    def _signal(self, child: Child, signum: int) -> None:
        if child.process is not None and child.process.poll() is None:
            try:
                os.killpg(child.process.pid, signum)
            except ProcessLookupError:
                pass

    def _stop_all(self, dispatcher: Child) -> None:
        workers = [c for c in self.children if c is not dispatcher]
        for group in (workers, [dispatcher]):
            for child in group:
                self._signal(child, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                if child.process is None:
                    continue
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs: killing it", child.name, STOP_GRACE_S)
                    self._signal(child, signal.SIGKILL)
                    child.process.wait()
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=5)

    def _wait_ready(self, dispatcher: Child) -> bool:
        """The dispatcher is ready once it has written its state file naming its own pid."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if dispatcher.process.poll() is not None:
                return False
            state = read_state_file(self.run_dir)
            if state is not None and state.pid == dispatcher.process.pid:
                return True
            time.sleep(0.05)
        return False

    # -- run ------------------------------------------------------------------------------------
    def run(self) -> int:
        config = self.config
        load_lengths(config.data, config.schedule, config.run)  # raises DataError, naming the file: exit 2
        if config.target.tp_size > 1 and not config.target.sim:  # a target that cannot run as a group: exit 2
            check_tensor_parallel(config.target.model, config.target.tp_size)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_free_space(self.run_dir, self.config.run.min_free_mb)
        self.log_dir.mkdir(exist_ok=True)
        config_path = write_resolved(self.config)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self._stop.set())
        dispatcher = Child("dispatcher", "dispatcher", self._command("dispatcher", "--config", str(config_path)),
                           dict(os.environ, PYTHONUNBUFFERED="1"), max_restarts=0)
        self.children = [dispatcher]
        log.info("run directory %s", self.run_dir)
        self._start(dispatcher)
        try:
            if not self._wait_ready(dispatcher):
                code = dispatcher.process.poll()
                log.error("the dispatcher did not come up (exit code %s); see %s", code, self.log_dir / "dispatcher.log")
                if self._stop.is_set():
                    return 130
                return code if code in (2, STORAGE_FAILED_EXIT_CODE) else 1  # a refusal or a full disk, as it said
            self.children += self._plan(config_path)
            for child in self.children[1:]:
                self._start(child)
            return self._supervise(dispatcher)
        finally:
            self._stop_all(dispatcher)

    def _supervise(self, dispatcher: Child) -> int:
        workers = self.children[1:]
        while not self._stop.wait(0.2):
            code = dispatcher.process.poll()
            if code is not None:
                if code != 0:
                    log.error("the dispatcher exited with code %d", code)
                    return code
                if not _run_completed(self.run_dir):
                    log.error("the dispatcher stopped before the run was complete (was it stopped from outside?)")
                    return 1
                log.info("run complete: every epoch committed")
                try:
                    print(format_report(build_report(self.run_dir)), flush=True)
                except (OSError, ValueError, KeyError) as exc:  # the run is done; a report problem is not a failure
                    log.warning("no run report: %s", exc)
                return 0
            for child in workers:
                code = child.process.poll()
                if code is None or child.finished:
                    continue
                if code == 0:
                    child.finished = True
                    continue
                if code == EXIT_UNUSABLE or child.restarts >= child.max_restarts:
                    child.finished = True
                    if code == EXIT_UNUSABLE:
                        log.error("%s exited with code %d: it cannot work in this run as configured (its log says "
                                  "why), not restarted", child.name, code)
                    else:
                        log.error("%s exited with code %d and has used its %d restart(s)", child.name, code,
                                  child.max_restarts)
                    if all(c.finished and c.process.returncode != 0 for c in workers if c.role == child.role):
                        log.error("no %s is left: stopping the run", child.role)
                        return code if code == STORAGE_FAILED_EXIT_CODE else 1  # a full disk says so
                    continue
                child.restarts += 1
                log.warning("%s exited with code %d: restart %d/%d", child.name, code, child.restarts, child.max_restarts)
                self._start(child)
        log.info("interrupted: stopping workers, then the dispatcher")
        return 130
