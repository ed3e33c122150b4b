"""What ``hsd bench chaos`` reports of a run: its events, the witness, rollbacks and leftovers.

Exactly-once is judged by the models' own records (``hsd report``'s witness), steps rolled back
by the journal's ``commit`` and ``rollback`` records, and what outlived the run by looking at the
machine: shared-memory segments of the run's id in /dev/shm, processes of its sessions.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from benchmarks.chaos_plan import ATTACH, DETACH, KILL, ROLES
from common.dataplane.shm_segment import ShmSegment, list_segments
from common.run.records.events import Event, MembershipOpened, ModelRolledBack, StepCommitted
from common.run.records.journal import read_journal
from common.wire.client import run_id_for
from ops.report import build_report


def rollbacks_from_journal(events: Iterable[Event]) -> dict[str, int]:
    """Committed steps the ledger rolled back, per cause, from a journal's ``commit`` and ``rollback``
    records. A rollback takes a model from its latest committed step back to the record's step.

    The cause is the record's own ``cause`` (the dispatcher names ``restart``: a drafter, or a
    group none of whose live ranks held the committed step, came back from its checkpoint); for a
    journal written before records named it, ``membership`` when a membership record of the model
    came after its last commit (a fixed-size group went back to a checkpoint), else ``restart``."""
    latest: dict[str, int] = {}
    regrouped: set[str] = set()
    rolled: Counter = Counter()
    for e in events:
        if isinstance(e, StepCommitted):
            model = e.model or e.w
            latest[model] = max(latest.get(model, 0), e.step)
            regrouped.discard(model)
        elif isinstance(e, MembershipOpened):
            regrouped.add(e.model)
        elif isinstance(e, ModelRolledBack):
            model, step = e.model, e.step
            lost = latest.get(model, 0) - step
            if lost > 0:
                rolled[e.cause or ("membership" if model in regrouped else "restart")] += lost
            latest[model] = min(latest.get(model, 0), step)
    return dict(rolled)


START_MARK = "chaos: process started:"  # the supervisor's line in a process's log before each incarnation
_REGISTERED = re.compile(r"registered as \S+ with run \S+, ([\d.]+)s after the process started")
_FIRST_STEP = re.compile(r"first step \d+ applied ([\d.]+)s after the process started")


def joiner_starts(logs_dir: Path) -> dict[str, dict[str, float]]:
    """How soon a drafter started into the running run (an attach, a restart) takes part: seconds
    from its process start to its first registration, and to its first step applied as a member of
    a group (a group's ranks log it), each as {count, median, max}, from the drafters' own logs."""
    register, first_step = [], []
    for path in sorted(logs_dir.glob("drafter-*.log")):
        for incarnation in path.read_text(errors="replace").split(START_MARK)[1:]:
            if incarnation.split("\n", 1)[0].strip() == "start":
                continue  # started with the run, before the chaos: not a joiner
            for pattern, found in ((_REGISTERED, register), (_FIRST_STEP, first_step)):
                match = pattern.search(incarnation)
                if match:
                    found.append(float(match.group(1)))
    return {name: {"count": len(v), "median": round(statistics.median(v), 1), "max": round(max(v), 1)}
            for name, v in (("register_s", register), ("first_step_s", first_step)) if v}


def steps_in(events: Iterable[Event], start: float | None, end: float | None) -> int:
    """Commit records journaled between ``start`` and ``end`` (wall clock; an open end: to the last)."""
    if start is None:
        return 0
    return sum(1 for e in events if isinstance(e, StepCommitted) and start <= e.t and (end is None or e.t <= end))


def figures(supervisor, run_dir: Path, finished: bool) -> tuple[dict[str, Any], list[ShmSegment], list[int]]:
    """The bench's figures (``supervisor``: the run's ChaosSupervisor), and the segments and pids
    it found left behind."""
    report = build_report(run_dir)
    rolled = rollbacks_from_journal(read_journal(run_dir))
    during = steps_in(read_journal(run_dir), *supervisor.window)
    segments = list_segments(run_id_for(run_dir))
    orphans = supervisor.orphans()
    counts = supervisor.counts
    return {
        "kills": {role: counts[(KILL, role)] for role in ROLES},
        "attaches": counts[(ATTACH, "drafter")],
        "detaches": counts[(DETACH, "drafter")],
        "jobs_total": report["jobs_total"],
        "committed": report["committed"],
        "witness_duplicates": report["witness_duplicates"],
        "witness_missing": report["witness_missing"],
        "steps_rolled_back": sum(rolled.values()),
        "steps_rolled_back_by_cause": rolled,
        "shm_leftover": len(segments),
        "orphans": len(orphans),
        "finished": finished and report["finished"],
        "crashes": dict(supervisor.crashes),
        "events_skipped": supervisor.skipped,
        "reattached": supervisor.reattached,
        "dispatcher_restarts": report["restarts"],
        "steps": report["steps"],
        "steps_during_window": during,  # commits while the chaos lasted: does training go on under it?
        "wall_s": report["wall_s"],
        "joiners": joiner_starts(supervisor.logs_dir),  # process start to register, to first step as a member
        "run_dir": str(run_dir),
    }, segments, orphans


def clean_up(segments: list[ShmSegment], orphans: list[int]) -> None:
    """What the figures counted as left behind is removed, so the bench itself leaves nothing."""
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for segment in segments:
        Path(segment.path).unlink(missing_ok=True)


def format_figures(f: dict[str, Any], *, seed: int, mode: str) -> str:
    kills = ", ".join(f"{role} {n}" for role, n in f["kills"].items())
    causes = ", ".join(f"{c} {n}" for c, n in f["steps_rolled_back_by_cause"].items()) or "none"
    return "\n".join([
        f"chaos ({mode}, seed {seed}): {'finished' if f['finished'] else 'NOT finished'} in {f['wall_s']:.0f}s, "
        f"{f['steps']} steps ({f['steps_during_window']} while the chaos lasted), "
        f"{f['dispatcher_restarts']} dispatcher restart(s)",
        f"events    kills {sum(f['kills'].values())} ({kills}); attaches {f['attaches']}; detaches {f['detaches']}; "
        f"unplanned crashes {sum(f['crashes'].values())}",
        f"jobs      total {f['jobs_total']}  committed {f['committed']}",
        f"witness   duplicates {f['witness_duplicates']}  missing {f['witness_missing']} (the models' own records)",
        f"rollback  {f['steps_rolled_back']} committed step(s) rolled back ({causes})",
        f"leftover  shm segments {f['shm_leftover']}  processes {f['orphans']}",
        "joiners   " + ("; ".join(f"process start to {what.removesuffix('_s').replace('_', ' ')} median {v['median']}s, "
                                 f"max {v['max']}s ({v['count']})" for what, v in f["joiners"].items())
                        or "none started into the run"),
        *([f"waiting   {reason}" for reason in f["waiting_for"].get("reasons", [])]
          + [f"logs      kept in {f['logs']}"] if "waiting_for" in f else []),
    ])
