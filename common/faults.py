"""Faults a test switches on, to force the order of events it needs: all of them behind one variable.

``HSD_TEST_FAULTS`` holds comma-separated entries, each ``name=value`` (a flag: its name alone)::

    HSD_TEST_FAULTS="kill_at=drafter-0@committed:3,kill_at=drafter-1@committed:3,checkpoint_delay_s=0.5"

Each fault is an entry of :data:`FAULTS` (what it does, where, and the value it takes; no value
holds a comma); ``kill_at`` and ``stop_at`` may be given several times, every other name once. The variable is parsed once per process (again
only if it changes, as a test's monkeypatch does in-process), at import: an unknown name or a value
that does not parse stops the process there, the message naming the entry. Production runs never
set it, and each point below then costs one environment lookup.

Production code asks one function per point (:func:`checkpoint_before_publish`,
:func:`exit_before_commit_reply`, :func:`exit_after_step`, :func:`kill_at`, ...), never the
variable itself. A fault that must not fire again in the process that restarts (``kill_at``, the
dispatcher's exit) fires once per run directory: a marker file there says it fired.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("hsd.faults")

ENV = "HSD_TEST_FAULTS"
EXIT_MID_WRITE = 3  # exit code of a process stopped by checkpoint_exit_at_step or drafter_exit_after_step
KILL_POINTS = ("micro_batch", "backward", "allreduce", "commit", "committed")
ANY_DRAFTER = "*"  # stop_at's worker: whichever drafter reaches the point first


class FaultSpecError(ValueError):
    """``HSD_TEST_FAULTS`` names an unknown fault, or gives one a value that does not parse."""


@dataclass(frozen=True)
class KillAt:
    """SIGKILL (``kill_at``) or SIGSTOP (``stop_at``) the drafter named ``worker`` at ``point`` of its
    first step numbered ``step`` or later."""

    worker: str
    point: str
    step: int


def _step(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("a step is a positive integer")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("a count is an integer >= 0")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("seconds are a number >= 0")
    return value


def _path(text: str) -> str:
    if not text:
        raise ValueError("a path is not empty")
    return text


def _kill_at(text: str) -> KillAt:
    worker, at, rest = text.partition("@")
    point, colon, step = rest.partition(":")
    if not (worker and at and colon):
        raise ValueError("the form is <drafter name>@<point>:<step>")
    if point not in KILL_POINTS:
        raise ValueError(f"the point is one of {', '.join(KILL_POINTS)}")
    return KillAt(worker, point, _step(step))


RANK_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _rank_fault(text: str) -> tuple[str, int, int]:
    what, colon, rest = text.partition(":")
    rank, at, job = rest.partition("@")
    if what not in RANK_SIGNALS or not colon or not at:
        raise ValueError(f"the form is <{'|'.join(RANK_SIGNALS)}>:<rank>@<job>")
    rank_number = _step(rank)
    return what, rank_number, _step(job)


DISK_FULL_PLACES = ("journal", "snapshot", "checkpoint")


def _disk_full_at(text: str) -> tuple[str, int]:
    place, colon, count = text.partition(":")
    if place not in DISK_FULL_PLACES or not colon:
        raise ValueError(f"the form is <place>:<count>, the place one of {', '.join(DISK_FULL_PLACES)}")
    return place, _count(count)


@dataclass(frozen=True)
class Fault:
    name: str
    parse: Callable[[str], Any] | None  # None: a flag, written without a value
    what: str
    repeated: bool = False


FAULTS = {fault.name: fault for fault in (
    Fault("bench_gpu_stand_in", _seconds, "benchmarks.gpu: hsd bench gpu runs a CPU stand-in section first, with "
          "this deadline: it launches processes in a session of their own and waits (its deadline and SIGTERM, tested)"),
    Fault("checkpoint_delay_s", _seconds, "common.run.checkpoint_writer: every checkpoint write pauses this long with its "
          "files on disk, before it is published (a slow disk)"),
    Fault("checkpoint_exit_at_step", _step, "common.run.checkpoint_writer: the process exits (EXIT_MID_WRITE) with the "
          "checkpoint of this step written and not published; on every write of that step"),
    Fault("dispatcher_exit_before_commit_reply", _step, "dispatcher.server: the dispatcher exits once the commit of a "
          "model step >= this one is durable and before its reply is sent (the drafter never hears that it "
          "committed); once per run directory"),
    Fault("drafter_exit_after_step", _step, "drafter_worker.drafter_backend: the drafter exits (EXIT_MID_WRITE) right "
          "after it applies this step, between a commit and the next checkpoint (a resumed run must train exactly "
          "as an uninterrupted one); each time it does"),
    Fault("kill_at", _kill_at, "drafter_worker.loop: <name>@<point>:<step> SIGKILLs the drafter named <name> at "
          "<point> (micro_batch: before its second micro-batch; backward: inside the backward of its second "
          "micro-batch; allreduce: as it enters the gradient sum, its peers already in it; commit: rank 0 before "
          "it sends its commit, its peers waiting for the outcome; committed: rank 0 with "
          "its commit durable, before the outcome goes out to its peers) of its first step numbered <step> or "
          "later that it trains with peers; once per run directory", repeated=True),
    Fault("stop_at", _kill_at, "drafter_worker.loop: as kill_at, but SIGSTOP (the test sends SIGCONT); <name> may "
          "be * (whichever drafter reaches the point first); once per run directory", repeated=True),
    Fault("pending_outcome_delay_s", _seconds, "drafter_worker.commit: a group's rank 0 whose commit the restarted "
          "dispatcher could not answer waits this long before it shares that outcome, so its peers learn that the "
          "dispatcher forgot them from a refused heartbeat first"),
    Fault("log_weight_checksums", None, "drafter_worker.elastic_group: log the weights' CRC32 after every applied step"),
    Fault("target_stop_in_job", _path, "target_worker.loop: the first target of the run to take a job writes "
          "{name, pid, job_id} to this path and stops itself (SIGSTOP) before extracting it; once per path"),
    Fault("target_rank_fault", _rank_fault, "target_worker.tp_group: <kill|stop>:<rank>@<n> SIGKILLs (or SIGSTOPs) "
          "rank <rank> (>= 1) of a tensor-parallel target group inside the forward of the <n>-th job it runs, as it "
          "enters its second decoder layer (rank 0 then waits in that forward's collectives); once per run directory"),
    Fault("journal_fsync_fails_after", _count, "dispatcher.journal: every fsync of the journal after this many "
          "fails with EIO"),
    Fault("disk_full_at", _disk_full_at, "dispatcher.journal / dispatcher.recovery / common.run.checkpoint_writer: "
          "<place>:<n>: after n writes at that place (journal: each write of queued lines; snapshot, checkpoint: "
          "each one) every later one fails with "
          "ENOSPC, a journal write having written half its bytes (a disk that fills mid-write)", repeated=True),
    Fault("witness_duplicate", _count, "drafter_worker.sim: the sim drafter records this job id twice in its witness"),
    Fault("witness_drop", _count, "drafter_worker.sim: the sim drafter never records this job id in its witness"),
)}


def parse(text: str) -> dict[str, Any]:
    """``HSD_TEST_FAULTS``' value as {name: value} (``kill_at``: a tuple of :class:`KillAt`)."""
    found: dict[str, Any] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, eq, value = entry.partition("=")
        fault = FAULTS.get(name.strip())
        if fault is None:
            raise FaultSpecError(f"{ENV}: unknown fault {name.strip()!r} in {entry!r} (known: {', '.join(FAULTS)})")
        if fault.parse is None:
            if eq:
                raise FaultSpecError(f"{ENV}: {entry!r}: {fault.name} is a flag, written without a value")
            parsed: Any = True
        elif not eq:
            raise FaultSpecError(f"{ENV}: {entry!r}: {fault.name} takes a value ({fault.name}=...)")
        else:
            try:
                parsed = fault.parse(value.strip())
            except ValueError as exc:
                raise FaultSpecError(f"{ENV}: {entry!r}: bad value for {fault.name} ({exc})") from None
        if fault.repeated:
            found[fault.name] = (*found.get(fault.name, ()), parsed)
        elif fault.name in found:
            raise FaultSpecError(f"{ENV}: {entry!r}: {fault.name} is given twice")
        else:
            found[fault.name] = parsed
    return found


_parsed: tuple[str, dict[str, Any]] = ("", {})


def active() -> dict[str, Any]:
    """The faults switched on ({} when none): parsed when the variable's value is new to this process."""
    global _parsed
    text = os.environ.get(ENV, "")
    if text != _parsed[0]:
        _parsed = (text, parse(text))
    return _parsed[1]


def fires_once(run_dir: str | os.PathLike, name: str) -> bool:
    """True the first time ``name`` is asked for in ``run_dir`` (the marker file is made then)."""
    marker = Path(run_dir) / f"test-fault-{name}"
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


# -- the points -------------------------------------------------------------------------------------
def checkpoint_before_publish() -> Callable[[Path, int], None] | None:
    """The checkpoint writer's hook (files on disk, not yet published), or None when no fault needs it."""
    faults = active()
    delay_s, exit_at = faults.get("checkpoint_delay_s", 0.0), faults.get("checkpoint_exit_at_step", 0)
    if not delay_s and not exit_at:
        return None

    def fault(tmp: Path, step: int) -> None:
        if delay_s:
            time.sleep(delay_s)
        if step == exit_at:
            log.error("checkpoint of step %d written to %s, not published: exiting (%s checkpoint_exit_at_step)",
                      step, tmp, ENV)
            logging.shutdown()
            os._exit(EXIT_MID_WRITE)
    return fault


def exit_before_commit_reply(run_dir: str | os.PathLike, step: int) -> bool:
    """Whether the dispatcher exits instead of replying to the commit of ``step`` (once it is durable)."""
    at = active().get("dispatcher_exit_before_commit_reply")
    return at is not None and step >= at and fires_once(run_dir, "exit-before-commit-reply")


def delay_pending_outcome() -> None:
    """A group's rank 0 with a commit left pending holds its outcome back when ``pending_outcome_delay_s`` says so."""
    delay_s = active().get("pending_outcome_delay_s")
    if delay_s:
        log.warning("holding a pending commit's outcome back %.1fs (%s pending_outcome_delay_s)", delay_s, ENV)
        time.sleep(delay_s)


def exit_after_step(step: int, logger: logging.Logger, model_id: str) -> None:
    """A drafter backend that just applied ``step`` exits there when ``drafter_exit_after_step`` says so."""
    if active().get("drafter_exit_after_step") == step:
        logger.error("%s: exiting after step %d (%s drafter_exit_after_step)", model_id, step, ENV)
        os._exit(EXIT_MID_WRITE)


def kills_armed() -> bool:
    """Whether any ``kill_at`` or ``stop_at`` is set (a loop installs its backward hook only then)."""
    faults = active()
    return bool(faults.get("kill_at") or faults.get("stop_at"))


def kill_at(worker: str, point: str, *, step: int, run_dir: str | os.PathLike) -> None:
    """SIGKILL this process if a ``kill_at`` names ``worker`` at ``point`` of ``step`` or an earlier step
    (SIGSTOP for a ``stop_at``, whose worker may be any)."""
    faults = active()
    for kill in faults.get("kill_at", ()):
        if ((kill.worker, kill.point) == (worker, point) and kill.step <= step
                and fires_once(run_dir, f"kill-{worker}-{point}-{kill.step}")):
            log.error("%s: SIGKILL at %s of step %s (%s kill_at)", worker, point, kill.step, ENV)
            os.kill(os.getpid(), signal.SIGKILL)
    for stop in faults.get("stop_at", ()):
        if (stop.worker in (worker, ANY_DRAFTER) and stop.point == point and stop.step <= step
                and fires_once(run_dir, f"stop-{stop.worker}-{point}-{stop.step}")):
            log.error("%s: SIGSTOP at %s of step %s (%s stop_at)", worker, point, stop.step, ENV)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGSTOP)


def disk_full_after(place: str) -> int | None:
    """``disk_full_at``: how many writes at ``place`` succeed before the disk is full; None: no fault."""
    counts = [count for at, count in active().get("disk_full_at", ()) if at == place]
    return min(counts) if counts else None


_disk_writes: dict[str, int] = {}


def fill_disk_at(place: str, path: Path) -> None:
    """``disk_full_at`` for a place written whole (a snapshot): raises ENOSPC naming ``path`` once
    this process has made that many writes there."""
    allowed = disk_full_after(place)
    if allowed is None:
        return
    done = _disk_writes.get(place, 0)
    _disk_writes[place] = done + 1
    if done >= allowed:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected by {ENV})", str(path))


def log_weight_checksums() -> bool:
    return bool(active().get("log_weight_checksums"))


def stop_in_job(name: str, job_id: int) -> None:
    """``target_stop_in_job``: the first target to get here stops itself, its job held; once per path."""
    path = active().get("target_stop_in_job")
    if not path:
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"name": name, "pid": os.getpid(), "job_id": job_id}, f)
    try:
        os.link(tmp, path)  # complete when it appears; fails when another target was first
    except FileExistsError:
        return
    finally:
        os.unlink(tmp)
    log.error("%s: stopping inside job %d (%s target_stop_in_job)", name, job_id, ENV)
    os.kill(os.getpid(), signal.SIGSTOP)


def journal_fsyncs_allowed() -> int | None:
    """How many fsyncs the journal makes before every next one fails (None: no limit)."""
    return active().get("journal_fsync_fails_after")


def witness_faults() -> tuple[int | None, int | None]:
    """The sim drafter's planted witness faults: (the job id recorded twice, the job id never recorded)."""
    faults = active()
    return faults.get("witness_duplicate"), faults.get("witness_drop")


active()  # a malformed HSD_TEST_FAULTS stops the process as it starts, not when its point is first reached


def target_rank_fault_armed(rank: int) -> bool:
    """Whether ``target_rank_fault`` names this rank (its backend hooks a decoder layer only then)."""
    fault = active().get("target_rank_fault")
    return fault is not None and fault[1] == rank


def target_rank_fault(rank: int, job: int, *, run_dir: str | os.PathLike) -> None:
    """Inside rank ``rank``'s forward of the ``job``-th job it runs: signal itself if the fault says so."""
    fault = active().get("target_rank_fault")
    if fault is None:
        return
    what, at_rank, at_job = fault
    if (rank, job) == (at_rank, at_job) and fires_once(run_dir, f"target-rank-{what}-{rank}"):
        log.error("target rank %d: SIG%s inside the forward of its job #%d (%s target_rank_fault)", rank,
                  what.upper(), job, ENV)
        logging.shutdown()
        os.kill(os.getpid(), RANK_SIGNALS[what])
