"""A worker's health, sent with each heartbeat: slot copy times, and on a GPU CUDA memory and compiled graphs.

What ``hsd stats`` and ``/metrics`` show of it (docs/stats.md) lets an operator see an IPC mapping
that leaks (reserved memory growing job after job), a copy that stalls (p99 far above p50) or
shapes that keep recompiling. A worker on the CPU sends no GPU figures (absent, not zero), and any
worker sends its copy times once it copied a slot.

The memory comes from a :class:`CudaMemory` reader (torch's allocator by default; a test passes a
fake one), read on the control channel's I/O thread when the heartbeat goes out; the loops add one
copy time per slot (:meth:`CopyTimes.add`).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from typing import Any, Callable, Protocol

import msgspec

from common.wire.messages import GpuHealth, Heartbeat, SlotCopies
from common.worker.runtime import WorkerSession

COPY_WINDOW = 256  # the percentiles are over this many latest slot copies


class CudaMemory(Protocol):
    def allocated(self, device: Any) -> int: ...
    def reserved(self, device: Any) -> int: ...
    def peak(self, device: Any) -> int: ...


class TorchCudaMemory:
    """torch's caching allocator's figures for this process on ``device``."""

    def allocated(self, device: Any) -> int:
        import torch
        return int(torch.cuda.memory_allocated(device))

    def reserved(self, device: Any) -> int:
        import torch
        return int(torch.cuda.memory_reserved(device))

    def peak(self, device: Any) -> int:
        import torch
        return int(torch.cuda.max_memory_allocated(device))


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest rank (one of the values, never between two)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class CopyTimes:
    """The latest slot copies' wall times, ms each."""

    def __init__(self, window: int = COPY_WINDOW):
        self.latest: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, seconds: float) -> None:
        self.latest.append(seconds * 1e3)
        self.count += 1

    def quantiles(self) -> tuple[float, float] | None:
        """(p50, p99) in ms, None before the first copy."""
        latest = list(self.latest)  # the I/O thread reads while the loop appends
        if not latest:
            return None
        return round(percentile(latest, 0.5), 3), round(percentile(latest, 0.99), 3)

    def read(self) -> SlotCopies | None:
        """What a heartbeat carries: None before the first copy."""
        quantiles = self.quantiles()
        if quantiles is None:
            return None
        return SlotCopies(copies=self.count, copy_ms_p50=quantiles[0], copy_ms_p99=quantiles[1])


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process (0 when nothing was compiled; dynamo is never imported here)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(utils.counters["stats"].get("unique_graphs", 0))


def is_cuda(device: Any) -> bool:
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


class GpuHealthProbe:
    """What a worker on ``device`` reports; :meth:`read` is None off the GPU."""

    def __init__(self, device: Any, memory: CudaMemory | None = None):
        self.device = device
        self.memory = memory if memory is not None else TorchCudaMemory()

    def read(self) -> GpuHealth | None:
        if not is_cuda(self.device):
            return None
        return GpuHealth(memory_allocated_bytes=self.memory.allocated(self.device),
                         memory_reserved_bytes=self.memory.reserved(self.device),
                         memory_peak_bytes=self.memory.peak(self.device), compiled_graphs=compiled_graphs())


class ReportingSession(WorkerSession):
    """A worker session whose heartbeats carry :attr:`health`'s reading and :attr:`copies`' when they give one."""

    health: Callable[[], GpuHealth | None] | None = None
    copies: CopyTimes | None = None

    def _heartbeat(self) -> Heartbeat | None:
        beat = super()._heartbeat()
        if beat is None:
            return beat
        try:
            gpu = self.health() if self.health is not None else None
            copies = self.copies.read() if self.copies is not None else None
        except Exception:  # noqa: BLE001 - a health figure never stops the heartbeat that keeps the worker alive
            return beat
        if gpu is None and copies is None:
            return beat
        return msgspec.structs.replace(beat, gpu=gpu, copies=copies)
