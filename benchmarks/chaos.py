"""``hsd bench chaos``: a multi-epoch run while seeded SIGKILLs hit targets, drafters and the dispatcher.

The bench is its own supervisor (as ``hsd launch`` is, but one that also kills): it starts the
dispatcher and every worker as processes of their own, fires the events of a seeded plan
(:mod:`benchmarks.chaos_plan`) — SIGKILL a target, a drafter (a rank of the group with
``--real``) or the dispatcher, SIGTERM a drafter (detach), start one more (attach) — and starts a
killed process again a moment later, as ``hsd launch`` would. Every event is logged as one line:
time, action, role, name, pid. After the chaos window it stops firing, lets the run finish, and
judges it by the models' own witness (``hsd report``), then counts what outlived the run: shared-
memory segments of its run id left in /dev/shm, and processes of its sessions still alive.

- sim (default): sim targets and sim drafters, each drafter training a model of its own; attach
  starts a new drafter (a new model), detach stops one (its model keeps what it committed).
- ``--real``: the demo's tiny target (built once by ``hsd make-tiny``) and DFlash drafters in a
  data-parallel group of 2 (gloo). A group of fixed size takes a rank only where one left, so the
  plan pairs each detach with an attach; an elastic one (``drafter.min_ranks``) takes up to 4.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.chaos_figures import START_MARK, clean_up, figures, format_figures
from benchmarks.chaos_plan import ATTACH, DETACH, KILL, ChaosEvent, build_plan
from benchmarks.chaos_setups import ChaosSetup, real_inputs, real_setup, sim_setup
from common.child_process import die_with_parent  # a killed bench takes its run with it, as hsd launch does
from common.run.config import ConfigError, load_config, write_resolved
from common.run.records.rundir import read_state_file
from common.wire.stats_snapshot import ModelView, Snapshot, to_json_object
from ops.stats_view import run_stats_or_none

JSON_KEYS = ("kills", "attaches", "detaches", "jobs_total", "committed", "witness_duplicates", "witness_missing",
             "steps_rolled_back", "shm_leftover", "orphans")
STOP_GRACE_S = 20.0         # a detached or stopping worker gets this long to leave before SIGKILL
READY_TIMEOUT_S = 120.0
SETTLED_AFTER_S = 1.0       # a process started this long ago may be hit again
SKIP_AFTER_S = 5.0          # an event not possible this long (and a whole gap) is skipped: the plan goes on
WINDOW_WALL_FACTOR = 6      # a window whose run barely serves ends after this many times its length


@dataclass
class Proc:
    name: str
    role: str
    popen: subprocess.Popen
    detached: bool = False      # sent SIGTERM by a detach: its exit is expected
    killed: bool = False        # SIGKILLed by the plan (or crashed): started again by a scheduled restart
    stop_deadline: float | None = None
    started: float = field(default_factory=time.monotonic)


@dataclass
class ChaosLog:
    started: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    quiet: bool = False

    def event(self, action: str, role: str, name: str, pid: int | None, note: str = "") -> None:
        line = (f"chaos t={time.monotonic() - self.started:7.2f}s  {action:<8} {role:<10} {name:<12} "
                f"pid {pid if pid is not None else '-':<8} {note}").rstrip()
        self.lines.append(line)
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


class ChaosSupervisor:
    """Starts, kills and restarts the run's processes per the plan; judges nothing itself."""

    def __init__(self, setup: ChaosSetup, config_path: Path, run_dir: Path, log: ChaosLog):
        self.setup = setup
        self.config_path = config_path
        self.run_dir = run_dir
        self.log = log
        self.logs_dir = run_dir / "chaos-logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.restarts: list[tuple[float, str, str]] = []   # (due, name, role)
        self.sessions: set[int] = set()                      # every session this run started
        self.started: list[subprocess.Popen] = []            # every process, reaped at the end
        self.counts: Counter = Counter()                     # (action, role) fired
        self.crashes: Counter = Counter()                    # unplanned non-zero exits, by role
        self.next_drafter = setup.num_drafters
        self.skipped = 0                                     # plan events dropped as not applicable
        self.reattached = 0
        self._serving, self._serving_checked = False, 0.0
        self.progress = 0.0                                  # share of the run's jobs committed (last stats)
        self.held: set[int] = set()                          # pids of targets held (SIGSTOP) while the work is ahead
        self.window: tuple[float | None, float | None] = (None, None)  # wall clock (journal time) of the window
        self.dispatcher_done = False

    # -- processes ------------------------------------------------------------------------------
    def start(self, name: str, role: str, why: str = "start") -> Proc:
        argv = [sys.executable, "-m", "hsd.cli", role, "--config", str(self.config_path)]
        if role != "dispatcher":
            argv += ["--name", name]
        with open(self.logs_dir / f"{name}.log", "ab") as out:
            out.write(f"{START_MARK} {why}\n".encode())  # one log holds every incarnation: where each begins
            out.flush()
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.sessions.add(popen.pid)
        self.started.append(popen)
        proc = self.procs[name] = Proc(name, role, popen)
        return proc

    def live(self, role: str) -> list[Proc]:
        """The role's processes a plan event may hit: running, neither killed nor detached, and up
        for a moment (events that piled up behind a skipped one do not all hit the same restart)."""
        settled = time.monotonic() - SETTLED_AFTER_S
        return sorted((p for p in self.procs.values() if p.role == role and p.popen.poll() is None
                       and not p.detached and not p.killed and p.started <= settled), key=lambda p: p.name)

    def dispatcher_ready(self) -> bool:
        proc = self.procs.get("dispatcher")
        if proc is None or proc.popen.poll() is not None:
            return False
        state = read_state_file(self.run_dir)
        return state is not None and state.pid == proc.popen.pid

    def start_run(self) -> None:
        self.start("dispatcher", "dispatcher")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.dispatcher_ready():
            if time.monotonic() > deadline or self.procs["dispatcher"].popen.poll() is not None:
                raise RuntimeError(f"the dispatcher did not come up; see {self.logs_dir / 'dispatcher.log'}")
            time.sleep(0.05)
        for i in range(self.setup.num_targets):
            self.start(f"target-{i}", "target")
        for i in range(self.setup.num_drafters):
            self.start(f"drafter-{i}", "drafter")

    # -- the plan's events ----------------------------------------------------------------------
    def serving(self) -> bool:
        """The dispatcher is up and workers have registered with it (asked at most twice a second):
        every event lands on a run that works, so a dispatcher restart is not doubled up before
        anyone noticed it."""
        now = time.monotonic()
        if now >= self._serving_checked + 0.5:
            self._serving_checked = now
            stats = run_stats_or_none(self.run_dir) if self.dispatcher_ready() else None
            self._serving = bool(stats and stats.workers)
            if stats:
                self.progress = committed_share(stats)
        return self._serving and self.dispatcher_ready()

    def hold_targets(self, hold: bool) -> None:
        """SIGSTOP the live targets while the work is ahead of the plan's clock; SIGCONT them after."""
        if hold:
            for proc in self.procs.values():
                if proc.role == "target" and proc.popen.poll() is None and proc.popen.pid not in self.held:
                    if not self.held:
                        self.log.event("hold", "target", "-", None, f"(the work is ahead of the plan: "
                                                                   f"{self.progress:.0%} of the jobs committed)")
                    _signal(proc.popen, signal.SIGSTOP)
                    self.held.add(proc.popen.pid)
        elif self.held:
            for popen in self.started:
                if popen.pid in self.held:
                    _signal(popen, signal.SIGCONT)
            self.held.clear()
            self.log.event("resume", "target", "-", None)

    def possible(self, event: ChaosEvent) -> bool:
        # drafters of the run: running or about to be restarted, and not leaving
        drafters = len([p for p in self.procs.values() if p.role == "drafter" and not p.detached
                        and (p.killed or p.popen.poll() is None)])
        if event.action == DETACH:
            return drafters > self.setup.min_drafters and bool(self.live("drafter"))
        if event.action == ATTACH:
            return drafters < self.setup.max_drafters
        return event.role == "dispatcher" or bool(self.live(event.role))

    def fire(self, event: ChaosEvent) -> None:
        if event.action == ATTACH:
            name = f"drafter-{self.next_drafter}"
            self.next_drafter += 1
            proc = self.start(name, "drafter", ATTACH)
            self.log.event(ATTACH, "drafter", name, proc.popen.pid)
        else:
            candidates = [self.procs["dispatcher"]] if event.role == "dispatcher" else self.live(event.role)
            victim = candidates[int(event.pick * len(candidates))]
            if event.action == KILL:
                victim.killed = True
                _signal(victim.popen, signal.SIGKILL)
                self.restarts.append((time.monotonic() + event.restart_after_s, victim.name, victim.role))
                self.log.event(KILL, victim.role, victim.name, victim.popen.pid,
                               f"(restart in {event.restart_after_s:.1f}s)")
            else:
                victim.detached, victim.stop_deadline = True, time.monotonic() + STOP_GRACE_S
                _signal(victim.popen, signal.SIGTERM)
                self.log.event(DETACH, victim.role, victim.name, victim.popen.pid)
        self.counts[(event.action, event.role)] += 1

    # -- keeping the run going ------------------------------------------------------------------
    def tend(self) -> None:
        """Reap exits, start due restarts, restart unplanned crashes (as hsd launch would)."""
        now = time.monotonic()
        for due, name, role in [r for r in self.restarts if r[0] <= now]:
            self.restarts.remove((due, name, role))
            proc = self.start(name, role, "restart")
            self.log.event("restart", role, name, proc.popen.pid)
        for proc in list(self.procs.values()):
            code = proc.popen.poll()
            if proc.detached and code is None and proc.stop_deadline and now > proc.stop_deadline:
                _signal(proc.popen, signal.SIGKILL)
                self.log.event("stuck", proc.role, proc.name, proc.popen.pid, "did not leave: SIGKILL")
                proc.stop_deadline = None
            if code is None or proc.killed or proc.detached:
                continue
            if proc.role == "dispatcher" and code == 0:
                self.dispatcher_done = True
            elif code != 0 and not self.dispatcher_done:
                self.crashes[proc.role] += 1
                self.log.event("crashed", proc.role, proc.name, proc.popen.pid, f"exit code {code}: restarting")
                proc.killed = True
                self.restarts.append((now + 1.0, proc.name, proc.role))

    def reattach_unsaved_models(self, models: dict[str, ModelView]) -> None:
        """A detached sim drafter whose model holds commits after its last checkpoint the dispatcher
        knows of (killed and restarted, then detached before its next checkpoint; or its dispatcher
        was down as it left) holds the run open: the run is done only once every model's last step
        is checkpointed. Start it again: it rolls its model back to its checkpoint and finishes it."""
        for name, state in models.items():
            proc = self.procs.get(name)
            if proc is not None and proc.detached and proc.popen.poll() is not None and state.step > state.checkpoint:
                new = self.start(name, "drafter", "reattach")
                self.reattached += 1
                self.log.event("reattach", "drafter", name, new.popen.pid, "its model's last step is not checkpointed")

    def stop_all(self) -> None:
        self.hold_targets(False)  # a held process would take its SIGTERM only once continued
        workers = [p for p in self.procs.values() if p.role != "dispatcher"]
        for group in (workers, [p for p in self.procs.values() if p.role == "dispatcher"]):
            for proc in group:
                _signal(proc.popen, signal.SIGTERM)
            for proc in group:
                try:
                    proc.popen.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal(proc.popen, signal.SIGKILL)
                    proc.popen.wait()
        for popen in self.started:  # every earlier incarnation is reaped: no zombie counts as an orphan
            popen.wait()

    def orphans(self) -> list[int]:
        """Processes of this run's sessions, or naming its run directory, still alive."""
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if os.getsid(p.pid) in self.sessions or str(self.run_dir) in " ".join(p.info["cmdline"] or []):
                    found.append(p.pid)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return found


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt


def _signal(popen: subprocess.Popen, signum: int) -> None:
    if popen.poll() is None:
        try:
            os.kill(popen.pid, signum)  # the process alone, as the OOM killer or a crash would
        except ProcessLookupError:
            pass


def committed_share(stats: Snapshot) -> float:
    """The share of the run's jobs committed, from a stats snapshot: the epochs started so far give
    the jobs an epoch has (they differ a little with the batching), times the run's epochs."""
    epochs = stats.epochs
    if not epochs:
        return 0.0
    per_epoch = sum(e.jobs for e in epochs) / len(epochs)
    total = per_epoch * max(stats.epochs_total or 1, len(epochs))
    return sum(e.committed for e in epochs) / total if total else 0.0


def wait_until_training(supervisor: ChaosSupervisor, run_dir: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (stats := run_stats_or_none(run_dir)) is None or not stats.steps:
        supervisor.tend()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step committed within {READY_TIMEOUT_S:.0f}s; see {supervisor.logs_dir}")
        time.sleep(0.2)


def drive(setup: ChaosSetup, plan: list[ChaosEvent], run_dir: Path, *, window_s: float,
          log: ChaosLog) -> tuple[ChaosSupervisor, dict[str, Any] | None]:
    """Run the plan over the window, then let the run finish; returns the supervisor and, for a run
    that did not finish within the settle timeout, what it waited for then (``waiting_for`` of its
    stats; None once it finished)."""
    config = load_config(setup.config_file, list(setup.overrides))
    supervisor = ChaosSupervisor(setup, write_resolved(config), run_dir, log)
    pending = list(plan)
    try:
        supervisor.start_run()
        wait_until_training(supervisor, run_dir)
        log.started = time.monotonic()  # the plan's clock starts on a run that trains
        supervisor.window = (time.time(), None)
        log.event("start", "run", "-", supervisor.procs["dispatcher"].popen.pid,
                  f"{setup.num_targets} target(s), {setup.num_drafters} drafter(s), {len(plan)} events planned")
        # The plan's clock runs only while the run serves (the dispatcher up, workers registered
        # with it): on a loaded machine, where a restarted process takes seconds to come back, every
        # event still lands on a working run, at the same point of the plan. An event fires once its
        # time has come and its share of the jobs is committed; while the work is ahead of the clock
        # (a fast machine) the targets are held, so the run cannot end before the plan does.
        clock, last, settle_end, next_stats, due_since = 0.0, time.monotonic(), None, 0.0, None
        wall_limit = log.started + window_s * WINDOW_WALL_FACTOR + READY_TIMEOUT_S
        while not supervisor.dispatcher_done:
            now = time.monotonic()
            serving = supervisor.serving()
            if serving:
                clock += now - last
            last = now
            if settle_end is None and ((clock >= window_s and not pending) or now > wall_limit):
                settle_end = now + setup.settle_timeout_s
                supervisor.window = (supervisor.window[0], time.time())
                log.event("settle", "run", "-", None, f"chaos window over ({clock:.1f}s of serving time)")
            if settle_end is not None and now > settle_end:
                stats = run_stats_or_none(run_dir)
                if stats is None:
                    return supervisor, {"reasons": ["no dispatcher answers"]}
                if stats.waiting_for is None:
                    return supervisor, {"reasons": ["done, but the dispatcher has not exited"]}
                return supervisor, to_json_object(stats.waiting_for)
            supervisor.tend()
            if (settle_end is None and serving and pending and clock >= pending[0].at_s
                    and supervisor.progress >= pending[0].at_progress):
                due_since = clock if due_since is None else due_since
                if supervisor.possible(pending[0]):
                    supervisor.fire(pending.pop(0))
                    due_since = None
                elif clock - due_since > max(setup.mean_gap_s, SKIP_AFTER_S):  # a detach with one drafter left
                    event = pending.pop(0)
                    supervisor.skipped += 1
                    due_since = None
                    log.event("skipped", event.role, event.action, None, "(not possible for a whole gap)")
            # the work never runs past the next event's share of it before that event fired
            supervisor.hold_targets(settle_end is None and bool(pending) and supervisor.progress >= pending[0].at_progress)
            if settle_end is not None and now >= next_stats:  # detached drafters stay away while the window lasts
                next_stats = now + 2.0
                stats = run_stats_or_none(run_dir)
                if stats:
                    supervisor.reattach_unsaved_models(stats.models)
            time.sleep(0.05)
        return supervisor, None
    finally:
        supervisor.stop_all()
        for event in pending:
            log.event("not run", event.role, event.action, None, f"(planned at {event.at_s:.1f}s)")


def run_chaos_bench(*, minutes: float, seed: int, real: bool, as_json: bool, work_dir: str | None = None,
                    inputs_dir: str = "runs/demo", keep: bool = False, quiet: bool = False) -> int:
    if minutes <= 0:
        raise ConfigError("--minutes must be positive")
    base = Path(work_dir or tempfile.mkdtemp(prefix="hsd-chaos-")).resolve()
    run_dir = base / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    window_s = minutes * 60
    if real:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers share the machine's cores
        inputs, config_file = real_inputs(Path(inputs_dir))
        setup = real_setup(run_dir, minutes, seed, inputs, config_file)
    else:
        setup = sim_setup(run_dir, minutes, seed)
    plan = build_plan(seed=seed, duration_s=window_s, mean_gap_s=setup.mean_gap_s, paired_attach=setup.paired_attach)
    log = ChaosLog(quiet=quiet)
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped bench stops its run's processes first (drive's finally)
    supervisor, waiting = drive(setup, plan, run_dir, window_s=window_s, log=log)
    finished = waiting is None
    result, segments, orphans = figures(supervisor, run_dir, finished)
    if not finished:  # what it waited for, and where its logs stay
        result["waiting_for"], result["logs"] = waiting, str(base)
    clean_up(segments, orphans)
    (base / "chaos-events.log").write_text("\n".join(log.lines) + "\n")
    print(json.dumps(result) if as_json else format_figures(result, seed=seed, mode="real" if real else "sim"),
          flush=True)
    if finished and not keep and work_dir is None:
        shutil.rmtree(base, ignore_errors=True)
    ok = finished and result["witness_duplicates"] == 0 and result["witness_missing"] == 0
    return 0 if ok else 1
