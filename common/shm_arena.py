"""POSIX shared-memory slot arena: one segment holding every slot of the pool.

The dispatcher creates the segment (and alone unlinks it); workers attach by name. The segment
is opened under ``/dev/shm`` with ``os.open`` + ``mmap`` rather than
``multiprocessing.shared_memory``, whose resource tracker would unlink the segment (or warn about a
"leak") when an attaching worker exits.

Names are ``hsd_<run_id>_<creator pid>``: a segment outlives a SIGKILLed dispatcher, and the pid in
its name lets :func:`sweep_dead_segments` tell such leftovers from a live run's pool.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import weakref
from dataclasses import dataclass

import psutil
import torch

from common.slots import SlotLayout, SlotView, format_bytes

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "hsd_"
_RUN_ID_RE = re.compile(r"[0-9A-Za-z]{1,32}")
_SEGMENT_RE = re.compile(r"hsd_([0-9A-Za-z]{1,32})_([0-9]+)")
# psutil derives a process start time from the boot time, which /proc gives in whole seconds.
_START_TIME_SLACK_S = 2.0
_CUDA_HOST_REGISTER_PORTABLE = 1


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-32 letters or digits (the dispatcher derives a hex id)")


def segment_name(run_id: str, pid: int | None = None) -> str:
    _check_run_id(run_id)
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


class _Mapping:
    """The mmap and its tensor, kept out of SlotArena so finalizers do not hold the arena alive."""

    def __init__(self, mm: mmap.mmap, nbytes: int):
        self.mm: mmap.mmap | None = mm
        # The tensor keeps the memoryview alive, and the memoryview pins an export on the mmap:
        # mmap.close() then refuses to unmap under a live view instead of leaving it dangling.
        self.view: memoryview | None = memoryview(mm)
        self.base: torch.Tensor | None = torch.frombuffer(self.view, dtype=torch.uint8, count=nbytes)
        self.pinned_ptr: int | None = None
        self.pinned_device: torch.device | None = None

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for CUDA, so copies between it and a GPU run async at full speed."""
        if not torch.cuda.is_available():
            return
        assert self.base is not None
        ptr, nbytes = self.base.data_ptr(), self.base.numel()
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            # Portable: pinned for every CUDA context of this process, not just the current device's.
            err = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        try:
            torch.cuda.check_error(err)
        except RuntimeError as exc:
            logger.warning("could not pin %s of shared memory (copies stay synchronous): %s",
                           format_bytes(nbytes), exc)
            return
        self.pinned_ptr = ptr
        self.pinned_device = device

    def release(self) -> None:
        if self.pinned_ptr is not None:
            # In-flight async copies may still touch the pages; unregistering under them is undefined.
            torch.cuda.synchronize(self.pinned_device)
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.pinned_ptr))
            self.pinned_ptr = None
        self.base = None
        self.view = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # a SlotView is still alive: the pages are unmapped when the last one goes
            self.mm = None


def _unlink(path: str, creator_pid: int) -> None:
    # A forked child inherits the finalizer but must never remove its parent's pool.
    if os.getpid() != creator_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SlotArena:
    """All slots of a pool in one shared-memory segment, with zero-copy views per slot."""

    def __init__(self, name: str, layout: SlotLayout, num_slots: int, mapping: _Mapping, *, owner: bool):
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.owner = owner
        self._mapping = mapping
        self._close = weakref.finalize(self, mapping.release)
        self._unlink = weakref.finalize(self, _unlink, self.path, os.getpid()) if owner else None

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @property
    def nbytes(self) -> int:
        return self.layout.slot_bytes * self.num_slots

    @classmethod
    def create(cls, run_id: str, layout: SlotLayout, num_slots: int, *, pin_device: torch.device | None = None
               ) -> SlotArena:
        """Create the run's pool (dispatcher side); fails if it does not fit or already exists.

        ``pin_device`` is for a creator that itself copies to or from a GPU; the dispatcher does not,
        and pinning there would only cost it a CUDA context.
        """
        if num_slots <= 0:
            raise ValueError(f"pool.slots must be positive, got {num_slots}")
        name = segment_name(run_id)
        nbytes = layout.slot_bytes * num_slots
        check_fits(num_slots, layout.slot_bytes)
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
                    raise ValueError(f"pool of {num_slots} slots × {format_bytes(layout.slot_bytes)} = "
                                     f"{format_bytes(nbytes)} does not fit in {SHM_DIR}; lower pool.slots or "
                                     f"schedule.tokens_per_batch") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, nbytes)
            mapping = _Mapping(_map(fd, nbytes), nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls._mapped(name, layout, num_slots, mapping, owner=True, pin_device=pin_device)

    @classmethod
    def attach(cls, name: str, layout: SlotLayout, num_slots: int, *, pin_device: torch.device | None = None
               ) -> SlotArena:
        """Map an existing pool (worker side); never unlinks it. Pin it when this process uses a GPU."""
        if not _SEGMENT_RE.fullmatch(name):
            raise ValueError(f"{name!r} is not an hsdispatch segment name (hsd_<run_id>_<pid>)")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory segment {name} does not exist: its dispatcher has exited "
                                    f"or runs on another host") from None
        try:
            size = os.fstat(fd).st_size
            nbytes = layout.slot_bytes * num_slots
            if size != nbytes:
                raise ValueError(f"segment {name} holds {size} bytes but {num_slots} slots of this layout need "
                                 f"{nbytes}: worker and dispatcher disagree on the layout")
            mapping = _Mapping(_map(fd, nbytes), nbytes)
        finally:
            os.close(fd)
        return cls._mapped(name, layout, num_slots, mapping, owner=False, pin_device=pin_device)

    @classmethod
    def _mapped(cls, name: str, layout: SlotLayout, num_slots: int, mapping: _Mapping, *, owner: bool,
                pin_device: torch.device | None) -> SlotArena:
        arena = cls(name, layout, num_slots, mapping, owner=owner)
        if pin_device is not None and pin_device.type == "cuda":
            mapping.pin(pin_device)  # page-locked for this process's async host<->device copies
        return arena

    @property
    def pinned(self) -> bool:
        return self._mapping.pinned_ptr is not None

    def slot(self, index: int) -> SlotView:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} is outside the pool of {self.num_slots}")
        base = self._mapping.base
        if base is None:
            raise RuntimeError(f"arena {self.name} is closed")
        start = index * self.layout.slot_bytes
        return SlotView(base[start:start + self.layout.slot_bytes], self.layout)

    def close(self) -> None:
        """Drop this process's mapping (idempotent); the segment itself stays until unlinked."""
        self._close()

    def unlink(self) -> None:
        """Remove the segment name (creator only, idempotent); mappings stay valid until closed."""
        if not self.owner:
            raise RuntimeError(f"only the creator of {self.name} may unlink it")
        assert self._unlink is not None
        self._unlink()

    def __enter__(self) -> SlotArena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        return f"SlotArena({self.name}, {self.num_slots} × {self.layout.describe()})"


def _map(fd: int, nbytes: int) -> mmap.mmap:
    # MAP_POPULATE builds the page tables up front so the first handoff does not pay for faults.
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


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
        _check_run_id(run_id)
    segments = []
    for entry in os.scandir(SHM_DIR):
        match = _SEGMENT_RE.fullmatch(entry.name)
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


def sweep_dead_segments(run_id: str | None = None) -> list[str]:
    """Remove the segments whose creator is gone (killed dispatchers); returns the removed names."""
    removed = []
    for segment in list_segments(run_id):
        if _creator_alive(segment):
            continue
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            continue  # a concurrent sweep got there first
        except PermissionError:
            logger.warning("cannot remove %s (another user's segment)", segment.path)
            continue
        removed.append(segment.name)
    return removed
