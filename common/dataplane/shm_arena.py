"""POSIX shared-memory slot arena: one segment holding every slot of the pool, as torch views.

The dispatcher creates the segment (:mod:`common.dataplane.shm_segment`, without torch) and alone unlinks it;
workers attach by name and map it with ``mmap``, without Python's resource tracker.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref

import torch

from common.dataplane.shm_segment import (SEGMENT_PREFIX, SEGMENT_RE, SHM_DIR, ShmSegment, check_fits, create_segment_fd,
                                list_segments, segment_name, sweep_dead_segments, unlink_segment)
from common.run.slot_layout import format_bytes
from common.dataplane.slots import SlotLayout, SlotView

logger = logging.getLogger(__name__)

__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "ShmSegment", "SlotArena", "check_fits", "list_segments", "segment_name",
           "sweep_dead_segments"]

_CUDA_HOST_REGISTER_PORTABLE = 1


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded into this process (its error state is the one to clear)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcudart.so"):
                    return ctypes.CDLL(fields[5].strip())
    except OSError:
        pass
    try:  # linked into torch itself, its symbols global
        lib = ctypes.CDLL(None)
        lib.cudaGetLastError  # noqa: B018 - raises AttributeError when absent
        return lib
    except (OSError, AttributeError):
        return None


class CudaHostRuntime:
    """The CUDA runtime calls that pinning makes: torch's bindings, plus ``cudaGetLastError`` from the
    runtime torch loaded (torch binds none). A failed ``cudaHostRegister`` also leaves its error as
    the thread's last error, which the next kernel launch's check would report as its own."""

    def __init__(self):
        self._cudart = torch.cuda.cudart()
        self._lib = _loaded_cudart()

    def host_register(self, ptr: int, nbytes: int, device: torch.device) -> int:
        with torch.cuda.device(device):
            # Portable: pinned for every CUDA context of this process, not just the current device's.
            return int(self._cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))

    def host_unregister(self, ptr: int, device: torch.device) -> int:
        # In-flight async copies may still touch the pages; unregistering under them is undefined.
        torch.cuda.synchronize(device)
        return int(self._cudart.cudaHostUnregister(ptr))

    def clear_last_error(self) -> int | None:
        """Reset the thread's last CUDA error; returns it (0: none), None when the runtime cannot be reached."""
        return int(self._lib.cudaGetLastError()) if self._lib is not None else None

    def error_string(self, err: int) -> str:
        return f"{self._cudart.cudaGetErrorString(self._cudart.cudaError(err))} (error {err})"


def cuda_host_runtime() -> CudaHostRuntime | None:
    return CudaHostRuntime() if torch.cuda.is_available() else None


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
        self.runtime: CudaHostRuntime | None = None

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for CUDA, so copies between it and a GPU run async at full speed.
        When the runtime refuses, the copies stay synchronous, and the refusal is cleared so that
        it does not surface at the next kernel launch."""
        runtime = cuda_host_runtime()
        if runtime is None:
            return
        assert self.base is not None
        ptr, nbytes = self.base.data_ptr(), self.base.numel()
        err = runtime.host_register(ptr, nbytes, device)
        if err != 0:
            cleared = runtime.clear_last_error()
            logger.warning("could not pin %s of shared memory (copies stay synchronous): %s%s", format_bytes(nbytes),
                           runtime.error_string(err),
                           "" if cleared is not None else "; the CUDA runtime's pending error could not be cleared")
            return
        self.pinned_ptr, self.pinned_device, self.runtime = ptr, device, runtime

    def release(self) -> None:
        if self.pinned_ptr is not None:
            assert self.runtime is not None and self.pinned_device is not None
            err = self.runtime.host_unregister(self.pinned_ptr, self.pinned_device)
            if err != 0:
                self.runtime.clear_last_error()
                logger.warning("could not unpin shared memory: %s", self.runtime.error_string(err))
            self.pinned_ptr = None
        self.base = None
        self.view = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # a SlotView is still alive: the pages are unmapped when the last one goes
            self.mm = None


class SlotArena:
    """All slots of a pool in one shared-memory segment, with zero-copy views per slot."""

    def __init__(self, name: str, layout: SlotLayout, num_slots: int, mapping: _Mapping, *, owner: bool):
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.owner = owner
        self._mapping = mapping
        # One view per slot, made on first use: a target and a drafter ask for a slot's view at every job,
        # and making one (five tensor views) cost more than a job's control messages.
        self._views: dict[int, SlotView] = {}
        self._close = weakref.finalize(self, mapping.release)
        self._unlink = weakref.finalize(self, unlink_segment, self.path, os.getpid()) if owner else None

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @property
    def nbytes(self) -> int:
        return self.layout.slot_bytes * self.num_slots

    @classmethod
    def create(cls, run_id: str, layout: SlotLayout, num_slots: int, *, pin_device: torch.device | None = None
               ) -> SlotArena:
        """Create a pool and map it (tests and tools; the dispatcher, which never reads a slot, creates
        its pool with :class:`common.dataplane.shm_segment.PoolSegment`). Fails if it does not fit or exists.

        ``pin_device`` is for a creator that itself copies to or from a GPU.
        """
        name, fd = create_segment_fd(run_id, num_slots, layout.slot_bytes)
        try:
            nbytes = layout.slot_bytes * num_slots
            mapping = _Mapping(_map(fd, nbytes), nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        os.close(fd)
        return cls._mapped(name, layout, num_slots, mapping, owner=True, pin_device=pin_device)

    @classmethod
    def attach(cls, name: str, layout: SlotLayout, num_slots: int, *, pin_device: torch.device | None = None
               ) -> SlotArena:
        """Map an existing pool (worker side); never unlinks it. Pin it when this process uses a GPU."""
        if not SEGMENT_RE.fullmatch(name):
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
        view = self._views.get(index)
        if view is None:
            start = index * self.layout.slot_bytes
            view = self._views[index] = SlotView(base[start:start + self.layout.slot_bytes], self.layout)
        return view

    def close(self) -> None:
        """Drop this process's mapping (idempotent); the segment itself stays until unlinked."""
        self._views.clear()  # the arena's own views must not keep the pages mapped
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
