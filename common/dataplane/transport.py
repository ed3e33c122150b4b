"""What workers use to move hidden states, whatever the transport kind.

The dispatcher picks the kind (:func:`common.dataplane.transport_info.resolve_transport`) and sends a
:data:`~common.run.descriptors.TransportInfo` in its register reply; a target opens a
:class:`TargetTransport` from it and writes slots, a drafter opens a :class:`DrafterTransport` and
reads them. With ``shm`` every worker maps the dispatcher's
pool; with ``cuda_ipc`` every target allocates its own slots on its GPU and sends the dispatcher
their :meth:`TargetTransport.export`, which drafters receive with each job as ``ipc``. ``nixl`` is
the same with the slots in the target node's memory, read across nodes (:mod:`common.dataplane.node_slots`).
"""

from __future__ import annotations

import logging
import time

import torch

from common.dataplane.cuda_ipc import CudaIpcOpener, CudaSlotBlock
from common.dataplane.node_slots import NodeSlotBlock, NodeSlotReader
from common.dataplane.shm_arena import SlotArena
from common.dataplane.slots import SlotBatch, SlotCopy, SlotHeader, SlotLayout, SlotView, start_copy
from common.dataplane.transport_info import (TRANSPORT_CHOICES, TRANSPORT_KINDS, cuda_ipc_transport_info,  # noqa: F401
                                   engine_missing, nixl_transport_info, resolve_transport, shm_transport_info)
from common.run.descriptors import CudaIpcExport, NixlInfo, ShmInfo, SlotExport, TransportInfo

class TargetTransport:
    """Writable slots of one target: the shared pool (shm) or the target's own GPU block (cuda_ipc)."""

    def __init__(self, kind: str, layout: SlotLayout, num_slots: int, device: torch.device, *,
                 arena: SlotArena | None = None, block: CudaSlotBlock | NodeSlotBlock | None = None):
        self.kind = kind
        self.layout = layout
        self.num_slots = num_slots
        self.device = device
        self._arena = arena
        self._block = block

    def slot(self, slot_id: int) -> SlotView:
        if self._arena is not None:
            return self._arena.slot(slot_id)
        assert self._block is not None
        return self._block.slot(slot_id)

    def export(self) -> SlotExport | None:
        """The target's own slots (CUDA IPC block, node segment) for its register message; None for shm."""
        return self._block.export() if self._block is not None else None

    def write(self, slot_id: int, header: SlotHeader, *, hs: torch.Tensor, input_ids: torch.Tensor,
              loss_mask: torch.Tensor, seq_lens: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """Copy one extracted batch into a slot and publish it; ``hs`` is ``[B, S, K*H]`` or ``[B*S, K*H]``.

        With ``stream`` the copies run there, after the work already queued on the current stream
        (which produced the tensors).
        """
        view = self.slot(slot_id)
        rows = header.num_rows
        if hs.numel() != rows * self.layout.row_width or hs.dtype != self.layout.torch_dtype:
            raise ValueError(f"hidden states {tuple(hs.shape)} {hs.dtype} do not match {header.batch_size} × "
                             f"{header.seq_len} rows of {self.layout.row_width} {self.layout.dtype}")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):  # a no-op for None
            view.begin_write()
            # Async D2H into pinned shm (or D2D on the GPU): ordered before the header by finish_write.
            view.hs[:rows].copy_(hs.reshape(rows, -1), non_blocking=True)
            view.input_ids[:rows].copy_(input_ids.reshape(-1), non_blocking=True)
            view.loss_mask[:rows].copy_(loss_mask.reshape(-1), non_blocking=True)
            view.seq_lens[:header.batch_size].copy_(seq_lens.reshape(-1), non_blocking=True)
        self.finish_write(slot_id, header, stream=stream)

    def finish_write(self, slot_id: int, header: SlotHeader | None = None, *,
                     stream: torch.cuda.Stream | None = None) -> None:
        """Make the slot's data complete, then publish ``header`` (if given) with its generation last.

        Call before reporting the job ready: the reader is another process and sees only memory.
        """
        view = self.slot(slot_id)
        if view.device.type == "cpu" and self.device.type == "cuda":
            # Host-side header stores are not ordered after async copies into shared memory.
            (stream if stream is not None else torch.cuda.current_stream(self.device)).synchronize()
        if header is not None:
            with torch.cuda.stream(stream):
                view.write_header(header)
        if self._block is not None:
            self._block.finish_write(slot_id, stream=stream)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        if self._block is not None:
            self._block.close()


log = logging.getLogger("hsd.transport")

# How often a cuda_ipc drafter looks for targets that left while it reads blocks it has open (a
# new block is looked at when it is first opened): a psutil look-up per open block.
DEPARTED_SWEEP_S = 5.0


class DrafterTransport:
    """Reads slots into a drafter's own memory, on a copy stream of its own on a GPU.

    With cuda_ipc it keeps the blocks of the targets it reads mapped, and drops a target's mapping
    once that target is gone (its process died, or it registered again with a new block), so a
    target's restart does not leave its old block pinned in every drafter's GPU memory.
    """

    def __init__(self, kind: str, layout: SlotLayout, device: torch.device, *, arena: SlotArena | None = None,
                 opener: CudaIpcOpener | NodeSlotReader | None = None):
        self.kind = kind
        self.layout = layout
        self.device = device
        self._arena = arena
        self._opener = opener
        # A side stream, so copies do not wait behind the training step queued on the compute stream.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # On the CPU every read lands in one staging slot, faulted in once.
        self._staging = (SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8), layout)
                         if device.type == "cpu" else None)
        self._next_sweep = 0.0
        self.num_released = 0  # blocks of departed targets dropped

    def start_read(self, slot_id: int, generation: int, *, ipc: SlotExport | None = None,
                   owner: str = "") -> SlotCopy:
        """Begin copying slot ``slot_id`` if it holds ``generation`` (else StaleSlotError).

        On a GPU the copy runs on the transport's copy stream while the compute already queued goes
        on; :meth:`SlotCopy.wait` gives the batch once this copy (and nothing else) is complete and
        the generation still holds, and orders the caller's stream after it: the slot may be
        released then. On a CPU drafter the copy is done on return, and the batch lives in the
        transport's staging slot until the next read (``clone()`` it to keep it longer); on a GPU
        it is a fresh allocation of the caching allocator.

        For cuda_ipc, ``ipc`` is the owning target's export and ``owner`` its worker id.
        """
        if self._opener is not None:
            if ipc is None:
                raise ValueError(f"a {self.kind} read needs the owning target's export (ipc=...)")
            if isinstance(self._opener, CudaIpcOpener):
                self._release_departed(ipc, owner)
            return self._opener.start_read(ipc, slot_id, generation, stream=self._stream, owner=owner)
        assert self._arena is not None
        return start_copy(self._arena.slot(slot_id), generation, self.device, stream=self._stream,
                          into=self._staging)

    def read(self, slot_id: int, generation: int, *, ipc: SlotExport | None = None, owner: str = "") -> SlotBatch:
        """:meth:`start_read`, waited for: the slot can be released as soon as this returns."""
        return self.start_read(slot_id, generation, ipc=ipc, owner=owner).wait()

    @property
    def pinned(self) -> bool:
        """Whether this process registered the shm pool's pages for async copies (False for cuda_ipc)."""
        return self._arena is not None and self._arena.pinned

    def forget(self, owner: str) -> None:
        """Drop a departed target's CUDA IPC block or node segment (no-op for shm)."""
        if self._opener is not None:
            self._opener.forget(owner=owner)

    def _release_departed(self, ipc: CudaIpcExport, owner: str) -> None:
        assert isinstance(self._opener, CudaIpcOpener)
        is_new = not self._opener.is_open(ipc, owner=owner)
        now = time.monotonic()
        if not is_new and now < self._next_sweep:
            return
        self._next_sweep = now + DEPARTED_SWEEP_S
        for gone in self._opener.departed(ipc if is_new else None):
            self.forget(gone)
            self.num_released += 1
            log.info("released the CUDA IPC block of target %s: its process is gone or it registered a new one",
                     gone)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        if self._opener is not None:
            self._opener.close()


def _resolve_device(device: torch.device | str) -> torch.device:
    # An explicit index, so that stream and pinning calls all name the same GPU.
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def open_target_transport(info: TransportInfo, device: torch.device | str) -> TargetTransport:
    kind, layout, num_slots = info.kind, info.layout, info.num_slots
    device = _resolve_device(device)
    if isinstance(info, ShmInfo):
        arena = SlotArena.attach(info.arena, layout, num_slots, pin_device=device)
        return TargetTransport(kind, layout, num_slots, device, arena=arena)
    if isinstance(info, NixlInfo):
        # Host memory even on a GPU target (copied into from a side stream): slots in GPU memory
        # across nodes (VRAM registration, GPUDirect) are not built yet.
        node_block = NodeSlotBlock(info.run_id, layout, num_slots, info.node, device)
        return TargetTransport(kind, layout, num_slots, device, block=node_block)
    block = CudaSlotBlock(layout, num_slots, device)
    return TargetTransport(kind, layout, num_slots, block.device, block=block)


def open_drafter_transport(info: TransportInfo, device: torch.device | str) -> DrafterTransport:
    kind, layout = info.kind, info.layout
    device = _resolve_device(device)
    if isinstance(info, ShmInfo):
        arena = SlotArena.attach(info.arena, layout, info.num_slots, pin_device=device)
        return DrafterTransport(kind, layout, device, arena=arena)
    if isinstance(info, NixlInfo):
        missing = engine_missing()  # said at start, not at the first read of another node's slot
        if missing:
            raise RuntimeError(missing)
        return DrafterTransport(kind, layout, device, opener=NodeSlotReader(layout, info.node, device))
    opener = CudaIpcOpener(layout, device)
    return DrafterTransport(kind, layout, opener.device, opener=opener)
