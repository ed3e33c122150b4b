"""Host copies of a training state's tensors, taken at a step boundary for a checkpoint.

A checkpoint is written on a thread while training goes on (:mod:`common.run.checkpoint_writer`), so
what it writes must be a copy no later step changes. On a CUDA device the copies land in pinned
host buffers — the copy runs at the bus's speed and the buffers, allocated once, serve every later
checkpoint of the same shapes — and the training thread waits once for all of them; on the CPU
they are plain clones.

The pinned buffers are allocated at their exact size and page-locked with ``cudaHostRegister``,
not taken from torch's caching host allocator (``pin_memory=True``), which rounds every block up
to a power of two and keeps it: up to twice the bytes of a large state, pinned for good. The
device tensors are copied as they are (the trainer's state dict does not clone them on the GPU
first), on the training thread between two steps.

A buffer is reused by the next :meth:`HostStaging.copy`, so a caller copies again only once the
previous copies are written: :class:`common.run.checkpoint_writer.CheckpointWriter` keeps at most one
checkpoint in flight, and the loops take a snapshot only after waiting for it.
"""

from __future__ import annotations

import logging
import weakref

import torch

from common.dataplane.shm_arena import CudaHostRuntime

log = logging.getLogger("hsd.checkpoint")


class PinnedBuffer:
    """A host tensor of exactly ``shape`` and ``dtype``, page-locked for async copies (pageable, and
    said once, when the runtime refuses: the copies then still happen, synchronously; the refusal is
    cleared so that the next kernel launch does not report it as its own)."""

    _refused_said = False

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, runtime: CudaHostRuntime):
        self.tensor = torch.empty(shape, dtype=dtype)  # the CPU allocator: exactly its bytes
        self.pinned = False
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if nbytes == 0:
            return
        ptr = self.tensor.data_ptr()
        err = runtime.host_register(ptr, nbytes, device)
        if err == 0:
            self.pinned = True
            # Run as this buffer goes, before its tensor's memory can (a copy handed out may hold it longer).
            weakref.finalize(self, runtime.host_unregister, ptr, device).atexit = False
            return
        runtime.clear_last_error()
        if not PinnedBuffer._refused_said:
            PinnedBuffer._refused_said = True
            log.warning("cudaHostRegister of a %d-byte checkpoint buffer failed (%s): checkpoint copies stay "
                        "synchronous", nbytes, runtime.error_string(err))


class HostStaging:
    def __init__(self, runtime: CudaHostRuntime | None = None) -> None:
        self._pinned: dict[str, PinnedBuffer] = {}  # name -> its buffer, reused while its shape holds
        self._runtime = runtime  # made at the first CUDA tensor

    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (same names), complete when this returns."""
        out: dict[str, torch.Tensor] = {}
        devices = set()
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            if tensor.device.type != "cuda":
                out[name] = tensor.clone(memory_format=torch.contiguous_format)
                continue
            buffer = self._pinned.get(name)
            if buffer is None or buffer.tensor.shape != tensor.shape or buffer.tensor.dtype != tensor.dtype:
                if self._runtime is None:
                    self._runtime = CudaHostRuntime()
                buffer = PinnedBuffer(tensor.shape, tensor.dtype, tensor.device, self._runtime)
                self._pinned[name] = buffer
            buffer.tensor.copy_(tensor, non_blocking=buffer.pinned)
            out[name] = buffer.tensor
            devices.add(tensor.device)
        for device in devices:  # one wait for every copy queued on the device
            torch.cuda.current_stream(device).synchronize()
        return out
