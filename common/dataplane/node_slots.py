"""The ``nixl`` transport: every target's slots live on its own node, read locally or across nodes.

A target allocates its block in a shared-memory segment of its node (created and unlinked by the
target, named like the dispatcher's pool so a dead target's segment is swept the same way) and
registers it with NIXL once. Its export names the node, the segment and the NIXL agent. A drafter
on the same node maps the segment and copies as with ``shm``; one on another node reads the slot
one-sided through the engine into the engine's registered buffer (no staging slot of its own).
Either way the generation check guards it.
"""

from __future__ import annotations

import logging

import torch

from common.dataplane.nixl_engine import RemoteSlotReader, SlotExporter
from common.dataplane.shm_arena import SlotArena
from common.dataplane.slots import SlotCopy, SlotLayout, SlotView, start_copy
from common.run.descriptors import NixlExport

log = logging.getLogger("hsd.transport")


class NodeSlotBlock:
    """A target's slots: a segment of its node's shared memory, registered with the engine once."""

    def __init__(self, run_id: str, layout: SlotLayout, num_slots: int, node: str,
                 device: torch.device = torch.device("cpu")):
        self.node = node
        self.device = device
        # Page-locked for a GPU target, whose copies into it then run async (as into the shm pool).
        self.arena = SlotArena.create(run_id, layout, num_slots, pin_device=device)
        try:
            self.exporter = SlotExporter(self.arena.slot(0).buffer.data_ptr(), self.arena.nbytes)
        except BaseException:
            self.close()
            raise

    def slot(self, index: int) -> SlotView:
        return self.arena.slot(index)

    def finish_write(self, index: int, *, stream: torch.cuda.Stream | None = None) -> None:
        """Nothing to add: TargetTransport.finish_write lets a GPU target's copies into host memory
        land before the header, as for the shm pool."""

    def export(self) -> NixlExport:
        return self.exporter.export(node=self.node, arena=self.arena.name)

    def close(self) -> None:
        exporter = getattr(self, "exporter", None)
        if exporter is not None:
            exporter.close()
        self.arena.close()
        self.arena.unlink()


class NodeSlotReader:
    """A drafter's reads: a mapped segment for an owner of its node, the engine for any other."""

    def __init__(self, layout: SlotLayout, node: str, device: torch.device):
        self.layout = layout
        self.node = node
        self.device = device
        self._agents: dict[str, str] = {}  # owner -> its NIXL agent, to drop it when the owner leaves
        self._local: dict[str, SlotArena] = {}  # owner -> its mapped segment
        self._not_here: set[str] = set()  # owners named this node whose segment this host lacks
        self._remote: RemoteSlotReader | None = None  # made at the first remote read
        self._staging: SlotView | None = None  # a CPU reader's copy of a local slot, made at its first one
        self.num_local = 0
        self.num_remote = 0

    def start_read(self, export: NixlExport, slot: int, generation: int, *,
                   stream: torch.cuda.Stream | None = None, owner: str = "") -> SlotCopy:
        """The slot's batch on the reader's device (views into the staging slot on a CPU reader).

        A local slot is copied as with shm (on ``stream`` on a GPU); a remote one is read through
        the engine with both generation checks before this returns, then moved to the GPU if any, on
        ``stream`` too.
        """
        arena = self._local_arena(export, owner) if export.node == self.node else None
        if arena is not None:
            if self.device.type == "cpu" and self._staging is None:
                self._staging = SlotView(torch.zeros(self.layout.slot_bytes, dtype=torch.uint8), self.layout)
            copy = start_copy(arena.slot(slot), generation, self.device, stream=stream, into=self._staging
                              if self.device.type == "cpu" else None)
            self.num_local += 1
            return copy
        if self._remote is None:
            self._remote = RemoteSlotReader(self.layout)
        self._agents[owner] = export.agent
        batch = self._remote.read(export, slot, generation)
        self.num_remote += 1
        if self.device.type == "cpu":
            return SlotCopy(self._remote.view, generation, batch, device=self.device)  # the engine's own buffer
        # Onto the GPU on the copy stream, not the compute stream: it need not wait for the training
        # queued there. The generation was checked on both sides of the read already.
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            batch = batch.copy_to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return SlotCopy(self._remote.view, generation, batch, device=self.device, stream=stream, event=event,
                        checked=True)

    def _local_arena(self, export: NixlExport, owner: str) -> SlotArena | None:
        """The owner's segment mapped, or None when its node has the drafter's name but no such segment:
        two hosts share a node name (a node's config used on another without its own ``--node``), so
        the slot is read through the engine, as any other node's, and the mix-up is said once."""
        arena = self._local.get(owner)
        if arena is None and owner not in self._not_here:
            try:
                arena = self._local[owner] = SlotArena.attach(export.arena, self.layout,
                                                              export.nbytes // self.layout.slot_bytes)
            except FileNotFoundError:
                self._not_here.add(owner)
                log.warning("%s's slots are named node %r, this drafter's node, but segment %s is not on this "
                            "host: two hosts use node name %r (start each with its own --node, or leave "
                            "nodes.name unset for its hostname); reading them through the engine", owner,
                            self.node, export.arena, self.node)
        return arena

    def forget(self, *, owner: str = "") -> None:
        """The owner left: unmap its segment, drop its agent."""
        self._not_here.discard(owner)
        arena = self._local.pop(owner, None)
        if arena is not None:
            arena.close()
        agent = self._agents.pop(owner, None)
        if agent is not None and self._remote is not None:
            self._remote.forget(agent)

    def close(self) -> None:
        for owner in set(self._local) | set(self._agents):
            self.forget(owner=owner)
        if self._remote is not None:
            self._remote.close()
            self._remote = None
