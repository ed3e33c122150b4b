"""Slot reads across nodes through NIXL (UCX inside: TCP on plain hosts, RDMA where the fabric has it).

NIXL is an optional extra (``pip install 'hsdispatch[multinode]'``). This module imports it only when
an engine object is made, so a one-node run never loads it; :func:`engine_missing` says, without
importing anything, why a multi-node run cannot start here.

A target registers its whole slot block with its agent once (:class:`SlotExporter`) and hands the
dispatcher an export: its agent's metadata and the block's address. A drafter on another node adds
that agent once (:class:`RemoteSlotReader`) and reads a slot with one-sided READs into its own
registered staging slot: the header first (the generation before), then the rows in use, then the
generation word again (after), as a local copy does. The owner's CPU takes no part beyond UCX's
progress thread.
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from typing import Any

import torch

from common.dataplane.host_staging import PinnedBuffer
from common.dataplane.shm_arena import CudaHostRuntime, cuda_host_runtime
from common.run.slot_layout import HEADER_BYTES, StaleSlotError
from common.dataplane.slots import SlotBatch, SlotLayout, SlotView
from common.dataplane.transport_info import ENGINE_MODULES, INSTALL_HINT, engine_missing
from common.run.descriptors import NixlExport

_GENERATION_OFFSET = 8  # the header's second int64 word (common.dataplane.slots: magic, generation, ...)

def _api() -> Any:
    missing = engine_missing()
    if missing:
        raise RuntimeError(missing)
    for name in ENGINE_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise RuntimeError(f"NIXL is installed but none of {', '.join(ENGINE_MODULES)} imports: {INSTALL_HINT}")


def _agent(role: str) -> Any:
    api = _api()
    name = f"hsd-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _dram(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0


class SlotExporter:
    """The owner's side: one agent with the slot block registered once, for the life of the target."""

    def __init__(self, address: int, nbytes: int):
        self.agent = _agent("owner")
        self._address, self._nbytes = address, nbytes
        self._registered = self.agent.register_memory([(address, nbytes, 0, "")], "DRAM")

    def export(self, *, node: str, arena: str) -> NixlExport:
        """What a reader needs, for the block in segment ``arena`` of ``node``: bytes and ints, no pickle."""
        return NixlExport(node=node, arena=arena, agent=self.agent.name,
                          metadata=bytes(self.agent.get_agent_metadata()), base=self._address, nbytes=self._nbytes)

    def close(self) -> None:
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None


class RemoteSlotReader:
    """The reader's side: one agent, one registered staging slot, every remote owner added once.

    Where CUDA is present the slot is page-locked (exactly its bytes, ``cudaHostRegister``), so the
    copy of a read batch onto the GPU is asynchronous; pageable when the runtime refuses."""

    def __init__(self, layout: SlotLayout, *, runtime: CudaHostRuntime | None = None):
        self.layout = layout
        self.agent = _agent("reader")
        runtime = runtime if runtime is not None else cuda_host_runtime()
        self._pinned = (PinnedBuffer(torch.Size([layout.slot_bytes]), torch.uint8, torch.device("cuda", 0), runtime)
                        if runtime is not None else None)
        self._staging = self._pinned.tensor.zero_() if self._pinned is not None else torch.zeros(
            layout.slot_bytes, dtype=torch.uint8)
        self._registered = self.agent.register_memory([(*_dram(self._staging), "")], "DRAM")
        self._view = SlotView(self._staging, layout)
        self._generation = torch.zeros(1, dtype=torch.int64)  # the after-check lands here, apart from the data
        self._registered_gen = self.agent.register_memory([(*_dram(self._generation), "")], "DRAM")
        self._peers: dict[str, str] = {}  # owner's agent name -> the name NIXL knows it by
        self.num_reads = 0
        self.bytes_read = 0

    @property
    def view(self) -> SlotView:
        """The registered slot every remote read lands in."""
        return self._view

    @property
    def pinned(self) -> bool:
        return self._pinned is not None and self._pinned.pinned

    def _peer(self, export: NixlExport) -> str:
        name = self._peers.get(export.agent)
        if name is None:
            name = self.agent.add_remote_agent(export.metadata)
            self._peers[export.agent] = name
        return name

    def _read(self, peer: str, pieces: list[tuple[int, int, int]]) -> None:
        """One READ of ``(local address, remote address, length)`` pieces, waited for."""
        local = self.agent.get_xfer_descs([(dst, n, 0) for dst, _, n in pieces], "DRAM")
        remote = self.agent.get_xfer_descs([(src, n, 0) for _, src, n in pieces], "DRAM")
        handle = self.agent.initialize_xfer("READ", local, remote, peer)
        try:
            state = self.agent.transfer(handle)
            spins = 0
            while state == "PROC":
                spins += 1
                if spins > 100:
                    time.sleep(20e-6)  # past the first round trip, let the owner's node have the core
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL read from {peer} failed ({state})")
        finally:
            self.agent.release_xfer_handle(handle)
        self.bytes_read += sum(n for _, _, n in pieces)

    def read(self, export: NixlExport, slot: int, generation: int) -> SlotBatch:
        """Slot ``slot`` of the owner ``export`` describes, if it still holds ``generation``.

        The batch is views into the staging slot, valid until the next read (as a CPU shm read).
        Raises :class:`StaleSlotError` when the generation differs before or after.
        """
        layout = self.layout
        if not 0 <= slot < export.nbytes // layout.slot_bytes:
            raise IndexError(f"slot {slot} is outside the owner's block of {export.nbytes // layout.slot_bytes}")
        peer = self._peer(export)
        base = export.base + slot * layout.slot_bytes
        staging = self._staging.data_ptr()
        self._read(peer, [(staging, base, HEADER_BYTES)])
        header = self._view.expect_generation(generation, when="before")
        rows = header.num_rows
        row_bytes = layout.row_width * self._view.hs.element_size()
        pieces = [(staging + offset, base + offset, n) for offset, n in (
            (layout.hs_offset, rows * row_bytes), (layout.input_ids_offset, rows * 4),
            (layout.loss_mask_offset, rows), (layout.seq_lens_offset, header.batch_size * 4))]
        self._read(peer, pieces)
        self._read(peer, [(self._generation.data_ptr(), base + _GENERATION_OFFSET, 8)])
        after = int(self._generation.item())
        if after != generation:
            raise StaleSlotError(generation, after, "after")
        self.num_reads += 1
        return self._view.batch(header)

    def forget(self, agent_name: str) -> None:
        """The owner left: drop its agent (a new one of the same target comes with a new name)."""
        name = self._peers.pop(agent_name, None)
        if name is not None:
            self.agent.remove_remote_agent(name)

    def close(self) -> None:
        for agent_name in list(self._peers):
            self.forget(agent_name)
        for registered in (self._registered, self._registered_gen):
            if registered is not None:
                self.agent.deregister_memory(registered)
        self._registered = self._registered_gen = None
