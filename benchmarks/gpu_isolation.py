"""Each section of ``hsd bench gpu`` in a process of its own, under a hard deadline.

The check (the parent) starts a section as ``python -m benchmarks.gpu_isolation NAME ...`` in a
session of its own and waits for its JSON until the section's deadline; past it, or when the
check itself gets SIGTERM or SIGINT, every process the check started is killed: the section's
process group, and every run it launched in a session of its own (``hsd launch`` and its workers).
Those are found as the check's descendants in ``/proc``; the check is made the subreaper of its
tree first, so a launched worker whose parent died is still its descendant. A section's GPU
memory, compiled kernels and CUDA context end with its process, so the next section starts clean.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

PR_SET_CHILD_SUBREAPER = 36


class Interrupted(BaseException):
    """The check got SIGTERM or SIGINT: what finished is written, what it started is stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt_on_signals() -> Callable[[], None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` in the main thread; returns what restores the handlers."""
    def handler(signum, _frame):
        raise Interrupted(signum)
    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)
    return restore


def become_subreaper() -> bool:
    """Orphans of this process's tree are re-parented to it (Linux), so they stay its descendants."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of ``pid`` from /proc, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[2]), fields[0]


def descendants(root: int) -> dict[int, int]:
    """{pid: process group} of every live (not zombie) process below ``root``."""
    parents: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[2] != "Z":
                parents[int(entry)] = (stat[0], stat[1])
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, pgid) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = pgid
                frontier.append(pid)
    return found


def _reap() -> None:
    """Collect the exit status of any orphan re-parented here (a subreaper's zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_descendants(root: int | None = None, *, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process below ``root`` (this one by default), by process group and one by one,
    until none is left; the pids it stopped."""
    root = os.getpid() if root is None else root
    own_group = os.getpgid(0)
    stopped: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        alive = descendants(root)
        if not alive or time.monotonic() > deadline:
            return sorted(stopped)
        for pid, pgid in alive.items():
            for kill, target in ((os.killpg, pgid), (os.kill, pid)):
                if kill is os.killpg and pgid in (own_group, 0):
                    continue
                try:
                    kill(target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            stopped.add(pid)
        time.sleep(0.05)
        if root == os.getpid():
            _reap()


def sweep_shared_memory() -> list[str]:
    """The shared-memory segments of processes just killed (their creators gone): removed, named."""
    try:
        from common.dataplane.shm_segment import sweep_dead_segments
        return sweep_dead_segments()
    except Exception:  # noqa: BLE001 - best effort after a kill; hsd cleanup --all-dead does the same later
        return []


def run_in_process(name: str, *, device: str, tmp: Path, deadline_s: float, tiny: bool,
                   progress: Callable[[str], None]) -> dict[str, Any]:
    """The section ``name`` in a child process, its figures; past ``deadline_s`` it and everything it
    started are killed and it reports ``timed_out``; :class:`Interrupted` propagates (the caller stops them)."""
    result = tmp / f"section-{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.gpu_isolation", name, device, str(tmp), f"{deadline_s:.3f}", str(result)]
    started = time.monotonic()
    # Its stdout joins the check's log (stderr): the check's own stdout carries its result alone (--json).
    proc = subprocess.Popen(command + (["--tiny"] if tiny else []), start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=sys.stderr)
    try:
        returncode = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        stopped = stop_descendants()
        proc.wait()
        swept = sweep_shared_memory()
        progress(f"{name}: stopped at its {deadline_s:.0f}s deadline ({len(stopped)} process(es) killed, "
                 f"{len(swept)} shared-memory segment(s) of theirs removed)")
        return {"error": f"timed out: not finished within its {deadline_s:.0f}s deadline; it and the "
                         f"{len(stopped)} process(es) it started were killed", "timed_out": True}
    # (Interrupted propagates: the caller stops everything and says which section it stopped.)
    left = stop_descendants()  # what it launched and left behind
    if left:
        progress(f"{name}: {len(left)} process(es) it left behind were killed")
    if result.is_file():
        return json.loads(result.read_text())
    return {"error": f"the section's process exited {returncode} without its figures "
                     f"({time.monotonic() - started:.1f}s; its output is in the log above)"}


STAND_IN_RUN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def stand_in(ctx: Any) -> dict[str, Any]:
    """A CPU stand-in for a section that launches a run: a process in a session of its own (as ``hsd
    launch`` is started) with a child of its own, both told in the progress log; then it waits past any
    deadline. Only a test switches it on (``HSD_TEST_FAULTS=bench_gpu_stand_in=SECONDS``)."""
    run = subprocess.Popen([sys.executable, "-c", STAND_IN_RUN], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    child = int(run.stdout.readline())
    ctx.progress(f"stand_in launched pids {run.pid} {child}")
    while True:
        time.sleep(1.0)


def main(argv: list[str]) -> int:
    """The child: ``NAME DEVICE TMP DEADLINE_S RESULT [--tiny]``: run the section, write its figures."""
    import torch

    from benchmarks.gpu import run_one, section_function
    from benchmarks.gpu_sections import TINY, CheckContext, Shapes
    from common.run.durable import atomic_write
    name, device, tmp, deadline_s, result = argv[:5]
    ctx = CheckContext(device=torch.device(device), tmp=Path(tmp), shapes=TINY if "--tiny" in argv else Shapes(),
                       deadline=time.monotonic() + float(deadline_s),
                       progress=lambda message: print(f"[bench gpu] {message}", file=sys.stderr, flush=True))
    figures = run_one(name, section_function(name), ctx)
    atomic_write(Path(result), json.dumps(figures), tmp_name=Path(result).name + ".part")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
