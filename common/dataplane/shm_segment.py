"""POSIX shared-memory segments of hsdispatch, without torch: names, creation, sweeping.

The dispatcher creates the run's pool segment (and alone unlinks it) but never reads a slot, so it
needs only this module; workers map the segment as torch views through :mod:`common.dataplane.shm_arena`.
Segments are opened under ``/dev/shm`` with ``os.open`` rather than ``multiprocessing.shared_memory``,
whose resource tracker would unlink the segment (or warn about a "leak") when an attaching worker exits.

Names are ``hsd_<run_id>_<creator pid>``: a segment outlives a SIGKILLed dispatcher, and the pid in
its name lets :func:`sweep_dead_segments` tell such leftovers from a live run's pool.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import weakref
from dataclasses import dataclass

import psutil

from common.run.slot_layout import SlotLayout, format_bytes

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "hsd_"
_RUN_ID_RE = re.compile(r"[0-9A-Za-z]{1,32}")
SEGMENT_RE = re.compile(r"hsd_([0-9A-Za-z]{1,32})_([0-9]+)")
# psutil derives a process start time from the boot time, which /proc gives in whole seconds.
_START_TIME_SLACK_S = 2.0


def check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-32 letters or digits (the dispatcher derives a hex id)")


def segment_name(run_id: str, pid: int | None = None) -> str:
    check_run_id(run_id)
    return f"{SEGMENT_PREFIX}{run_id}_{os.getpid() if pid is None else pid}"


def check_fits(num_slots: int, slot_bytes: int) -> None:
    """Raise ValueError when a pool of ``num_slots × slot_bytes`` cannot live in /dev/shm and RAM."""
    total = num_slots * slot_bytes
    st = os.statvfs(SHM_DIR)
    shm_free = st.f_bavail * st.f_frsize
    mem_free = psutil.virtual_memory().available
    limits = [(shm_free, f"{SHM_DIR} has {format_bytes(shm_free)} free"),
              (mem_free, f"only {format_bytes(mem_free)} of memory is available")]
    for free, reason in limits:
        if total > free:
            raise ValueError(f"pool of {num_slots} slots × {format_bytes(slot_bytes)} = {format_bytes(total)} does "
                             f"not fit: {reason}; lower pool.slots or schedule.tokens_per_batch")


def create_segment_fd(run_id: str, num_slots: int, slot_bytes: int) -> tuple[str, int]:
    """Create the run's pool segment with every page reserved; returns its name and an open fd.

    Fails if it does not fit or already exists. The caller closes the fd (after mapping it, if it
    reads the pool itself).
    """
    if num_slots <= 0:
        raise ValueError(f"pool.slots must be positive, got {num_slots}")
    name = segment_name(run_id)
    nbytes = slot_bytes * num_slots
    check_fits(num_slots, slot_bytes)
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise FileExistsError(f"shared-memory segment {name} already exists: this process already "
                              f"created run {run_id}'s pool") from None
    try:
        try:
            # Reserves every page now: a full /dev/shm fails here, not as a SIGBUS mid-run.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ValueError(f"pool of {num_slots} slots × {format_bytes(slot_bytes)} = "
                                 f"{format_bytes(nbytes)} does not fit in {SHM_DIR}; lower pool.slots or "
                                 f"schedule.tokens_per_batch") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return name, fd


def unlink_segment(path: str, creator_pid: int) -> None:
    # A forked child inherits the finalizer but must never remove its parent's pool.
    if os.getpid() != creator_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class PoolSegment:
    """The run's pool as the dispatcher owns it: created at start, unlinked at the end, never mapped."""

    def __init__(self, run_id: str, layout: SlotLayout, num_slots: int):
        self.name, fd = create_segment_fd(run_id, num_slots, layout.slot_bytes)
        os.close(fd)
        self.layout = layout
        self.num_slots = num_slots
        self.nbytes = num_slots * layout.slot_bytes
        self._unlink = weakref.finalize(self, unlink_segment, self.path, os.getpid())

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def unlink(self) -> None:
        """Remove the segment name (idempotent); workers' mappings stay valid until they close them."""
        self._unlink()


@dataclass(frozen=True)
class ShmSegment:
    name: str
    run_id: str
    pid: int
    nbytes: int
    mtime: float

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)


def list_segments(run_id: str | None = None) -> list[ShmSegment]:
    """hsdispatch segments in /dev/shm, optionally only those of one run."""
    if run_id is not None:
        check_run_id(run_id)
    segments = []
    for entry in os.scandir(SHM_DIR):
        match = SEGMENT_RE.fullmatch(entry.name)
        if not match or (run_id is not None and match.group(1) != run_id):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        segments.append(ShmSegment(entry.name, match.group(1), int(match.group(2)), st.st_size, st.st_mtime))
    return sorted(segments, key=lambda s: s.name)


def _creator_alive(segment: ShmSegment) -> bool:
    try:
        proc = psutil.Process(segment.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        # A process started after the segment was last written cannot have created it: the pid was reused.
        return proc.create_time() <= segment.mtime + _START_TIME_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def dead_segments(run_id: str | None = None) -> list[ShmSegment]:
    """Segments whose creator is gone (a killed dispatcher), optionally only those of one run."""
    return [segment for segment in list_segments(run_id) if not _creator_alive(segment)]


def sweep_dead_segments(run_id: str | None = None) -> list[str]:
    """Remove the segments whose creator is gone (killed dispatchers); returns the removed names."""
    removed = []
    for segment in dead_segments(run_id):
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            continue  # a concurrent sweep got there first
        except PermissionError:
            logger.warning("cannot remove %s (another user's segment)", segment.path)
            continue
        removed.append(segment.name)
    return removed
