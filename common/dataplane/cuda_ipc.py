"""CUDA IPC slots: a target keeps its slots on its own GPU, drafters copy device to device.

Each target allocates all its slots once, in one dedicated allocation, and exports the CUDA IPC
handle of that allocation in its register message. A drafter opens each handle once (cached) and
copies a slot into its own memory on a side stream; messages only carry ``(slot, generation)``.

The export (:class:`common.run.descriptors.CudaIpcExport`) is built from torch's storage sharing
primitives, but as plain msgpack values: no pickle, so a peer can never make a worker execute code.

Lifetime: torch's cross-process reference counting assumes each consumer releases what one send
handed it; here many drafters open one export for a whole run. So the producer drops its own
count at export (freeing the block at close is then immediate, without "producer terminated before
all shared CUDA tensors released" at exit), and consumers open with a reference counter name that
does not exist, making their release a no-op (the same path torch takes when a producer is gone).
Keeping the block alive while drafters read it is the dispatcher's job: it hands out references
to a target's slots only while that target is registered, and generations catch the rest. A
drafter drops its mapping of a target's block once that target is gone (its process died, or it
registered a new block): :meth:`CudaIpcOpener.departed`.

The driver refuses to open an IPC handle in the process that exported it ("invalid device
context"): an export of this very process is read from its block directly.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import weakref

import psutil
import torch

from common.dataplane.slots import SlotBatch, SlotCopy, SlotLayout, SlotView, start_copy
from common.run.descriptors import CudaIpcExport

# shm_open of this name fails, which is what turns a consumer's counter release into a no-op.
_NO_REF_COUNTER = b"/hsd_no_ipc_refcount"

# This process's blocks by block id, for an export opened where it was made.
_LOCAL_BLOCKS: "weakref.WeakValueDictionary[str, CudaSlotBlock]" = weakref.WeakValueDictionary()


class PeerMappingError(RuntimeError):
    """A target's block cannot be mapped onto this drafter's GPU (no peer access, no shared device)."""


def is_own_export(export: CudaIpcExport) -> bool:
    """Whether ``export`` was made by this process (then it is never opened through IPC)."""
    return export.pid == os.getpid() and export.host == socket.gethostname()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cuda_ipc_available() -> bool:
    """Whether this process can export and open CUDA IPC handles (Linux with a CUDA device)."""
    return sys.platform.startswith("linux") and torch.cuda.is_available()


def _device_uuid(index: int) -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def _cuda_device(device: torch.device | str | int) -> torch.device:
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        raise ValueError(f"CUDA IPC slots need a CUDA device, got {device}")
    if not cuda_ipc_available():
        raise ValueError("pool.transport=cuda_ipc needs CUDA on Linux, and this process has none; use shm")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


class CudaSlotBlock:
    """All of one target's slots in one GPU allocation (target side)."""

    def __init__(self, layout: SlotLayout, num_slots: int, device: torch.device | str | int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = _cuda_device(device)
        # Zeroed so every header starts at generation 0 ("never written").
        self.buffer: torch.Tensor | None = torch.zeros(num_slots * layout.slot_bytes, dtype=torch.uint8,
                                                       device=self.device)
        # Tells a restarted target's block apart from its predecessor's in a drafter's cache.
        self.block_id = secrets.token_hex(8)
        self._export: CudaIpcExport | None = None
        _LOCAL_BLOCKS[self.block_id] = self

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.slot_bytes

    def slot(self, index: int) -> SlotView:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} is outside the block of {self.num_slots}")
        if self.buffer is None:
            raise RuntimeError("CUDA slot block is closed")
        start = index * self.layout.slot_bytes
        return SlotView(self.buffer[start:start + self.layout.slot_bytes], self.layout)

    def export(self) -> CudaIpcExport:
        """What lets another process open this block (made once: the same handle every time)."""
        if self._export is None:
            if self.buffer is None:
                raise RuntimeError("CUDA slot block is closed")
            # The zero fill must be complete before any peer can map the block.
            torch.cuda.synchronize(self.device)
            storage = self.buffer.untyped_storage()
            # The IPC event torch adds is not passed on: the synchronize above already ordered the
            # only writes that precede the export, and later ones are published by finish_write.
            device_index, handle, storage_bytes, storage_offset, ref_counter, ref_counter_offset, _, _ = (
                storage._share_cuda_())
            torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, ref_counter_offset)
            self._export = CudaIpcExport(
                block_id=self.block_id, host=socket.gethostname(), pid=os.getpid(),
                device_index=int(device_index), device_uuid=_device_uuid(self.device.index),
                handle=bytes(handle), storage_bytes=int(storage_bytes), storage_offset=int(storage_offset),
                num_slots=self.num_slots, slot_bytes=self.layout.slot_bytes)
        return self._export

    def finish_write(self, index: int, *, stream: torch.cuda.Stream | None = None) -> None:
        """Wait until slot ``index``'s writes are done, before the target reports the job ready.

        A drafter copies the slot from its own process and stream, which orders nothing against
        this process's stream: the data must be complete in memory before the dispatcher hears of it.
        """
        assert 0 <= index < self.num_slots
        (stream if stream is not None else torch.cuda.current_stream(self.device)).synchronize()

    def close(self) -> None:
        self.buffer = None
        _LOCAL_BLOCKS.pop(self.block_id, None)


def _map_ipc_block(index: int, export: CudaIpcExport) -> torch.Tensor:
    """Open the export's IPC handle on device ``index`` as a flat uint8 tensor (RuntimeError if the driver refuses)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        index, export.handle, export.storage_bytes, export.storage_offset, _NO_REF_COUNTER, 0, b"", False)
    nbytes = export.num_slots * export.slot_bytes
    if storage.nbytes() < nbytes:
        raise ValueError(f"peer block holds {storage.nbytes()} bytes, its export claims {nbytes}")
    block = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    return block.set_(storage, 0, (nbytes,), (1,))


class CudaIpcOpener:
    """Opens peer targets' slot blocks once each and copies slots out of them (drafter side)."""

    def __init__(self, layout: SlotLayout, device: torch.device | str | int):
        self.layout = layout
        self.device = _cuda_device(device)
        self._blocks: dict[tuple[str, bytes], torch.Tensor] = {}
        self._sources: dict[tuple[str, bytes], tuple[int, str]] = {}  # key -> (exporting pid, block id)

    @property
    def num_open_blocks(self) -> int:
        return len(self._blocks)

    def open(self, export: CudaIpcExport, *, owner: str = "") -> torch.Tensor:
        """The peer's whole block as a flat uint8 tensor (cached by owner and handle)."""
        key = (owner or export.block_id, export.handle)
        block = self._blocks.get(key)
        if block is None:
            if export.slot_bytes != self.layout.slot_bytes:
                raise ValueError(f"peer block has {export.slot_bytes} bytes per slot, this layout "
                                 f"{self.layout.slot_bytes}: target and drafter disagree on the layout")
            block = self._open(export)
            self._blocks[key] = block
            self._sources[key] = (export.pid, export.block_id)
        return block

    def is_open(self, export: CudaIpcExport, *, owner: str = "") -> bool:
        return (owner or export.block_id, export.handle) in self._blocks

    def departed(self, export: CudaIpcExport | None = None, *, alive=process_alive) -> list[str]:
        """Owners of open blocks whose target is gone: its process died, or the process of ``export``
        (a block about to be opened) made that new block since (it registered again: a new worker id).
        Blocks of this very process (tests, benchmarks: several may live side by side) never are."""
        new_pid, new_block = (export.pid, export.block_id) if export is not None else (None, None)
        gone = []
        for key, (pid, block_id) in self._sources.items():
            if pid == os.getpid():
                continue
            if (pid == new_pid and block_id != new_block) or not alive(pid):
                gone.append(key[0])
        return list(dict.fromkeys(gone))

    def _open(self, export: CudaIpcExport) -> torch.Tensor:
        if is_own_export(export):
            local = _LOCAL_BLOCKS.get(export.block_id)
            if local is None or local.buffer is None:
                raise RuntimeError(f"CUDA IPC block {export.block_id} of this process is closed")
            return local.buffer
        # Mapping into our own device (peer access) avoids a CUDA context on the target's GPU;
        # without P2P between the two GPUs, fall back to the target's GPU when this process sees it.
        candidates = [self.device.index]
        owner_index = self._local_index(export)
        if owner_index is not None and owner_index != self.device.index:
            candidates.append(owner_index)
        errors = []
        for index in candidates:
            try:
                return _map_ipc_block(index, export)
            except RuntimeError as exc:
                errors.append(f"cuda:{index}: {exc}")
        raise PeerMappingError(
            f"cannot map the CUDA IPC block of target pid {export.pid} on {export.host} (GPU "
            f"{export.device_uuid or export.device_index}) onto this drafter's {self.device}: "
            f"{'; '.join(errors)}. Without peer access between the two GPUs, use pool.transport=shm")

    @staticmethod
    def _local_index(export: CudaIpcExport) -> int | None:
        """This process's index of the target's GPU, matched by UUID (CUDA_VISIBLE_DEVICES may differ)."""
        uuid = export.device_uuid
        if uuid is None:
            return None
        for index in range(torch.cuda.device_count()):
            if _device_uuid(index) == uuid:
                return index
        return None

    def start_read(self, export: CudaIpcExport, slot: int, generation: int, *,
                   stream: torch.cuda.Stream | None = None, owner: str = "") -> SlotCopy:
        """Begin copying slot ``slot`` of the peer block into new tensors on this drafter's device
        (device to device, on ``stream``); the :class:`SlotCopy` checks the generation again when waited for.

        Raises StaleSlotError when the slot does not hold ``generation`` before the copy.
        """
        if not 0 <= slot < export.num_slots:
            raise IndexError(f"slot {slot} is outside the peer block of {export.num_slots}")
        block = self.open(export, owner=owner)
        start = slot * self.layout.slot_bytes
        view = SlotView(block[start:start + self.layout.slot_bytes], self.layout)
        return start_copy(view, generation, self.device, stream=stream)

    def read_into(self, export: CudaIpcExport, slot: int, generation: int, *, stream: torch.cuda.Stream | None = None,
                  owner: str = "") -> SlotBatch:
        """:meth:`start_read`, waited for (StaleSlotError when the slot was rewritten before or during the copy)."""
        return self.start_read(export, slot, generation, stream=stream, owner=owner).wait()

    def forget(self, *, owner: str = "", block_id: str = "") -> None:
        """Close the blocks of a target that left (by owner, or by block id when no owner was given)."""
        for key in [k for k in self._blocks if k[0] in (owner, block_id) and k[0]]:
            del self._blocks[key]
            del self._sources[key]

    def close(self) -> None:
        self._blocks.clear()
        self._sources.clear()
