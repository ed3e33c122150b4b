"""Host copies of a training state's tensors, taken at a step boundary for a checkpoint.

A checkpoint is written on a thread while training goes on (:mod:`common.checkpoint_writer`), so
what it writes must be a copy no later step changes. On a CUDA device the copies land in pinned
host buffers — the copy runs at the bus's speed and the buffers, allocated once, serve every later
checkpoint of the same shapes — and the training thread waits once for all of them; on the CPU
they are plain clones.

A buffer is reused by the next :meth:`HostStaging.copy`, so a caller copies again only once the
previous copies are written: :class:`common.checkpoint_writer.CheckpointWriter` keeps at most one
checkpoint in flight, and the loops take a snapshot only after waiting for it.
"""

from __future__ import annotations

import torch


class HostStaging:
    def __init__(self) -> None:
        self._pinned: dict[str, torch.Tensor] = {}  # name -> pinned buffer, reused while its shape holds

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
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._pinned[name] = buffer
            buffer.copy_(tensor, non_blocking=True)
            out[name] = buffer
            devices.add(tensor.device)
        for device in devices:  # one wait for every copy queued on the device
            torch.cuda.current_stream(device).synchronize()
        return out
