"""The dispatcher's side of the data plane: create (and finally unlink) the slot memory it owns.

With ``shm`` the dispatcher creates one shared-memory arena holding every slot and tells workers
its name. With ``cuda_ipc`` each target allocates its own slots on its GPU and registers their IPC
handle; the dispatcher only relays the handle to drafters. ``nixl`` is the same across nodes: each
target's slots live in its own node's memory, registered with the engine. Either way no tensor byte passes here,
and nothing here imports torch: the dispatcher never maps the slots it accounts for.
"""

from __future__ import annotations

import logging
import socket

from common.run.config import DrafterSection, NodesSection, PoolSection, TargetSection
from common.run.descriptors import TransportInfo
from common.wire.messages import ErrorCode, ProtocolError, Register
from common.wire.stats_snapshot import TransportView
from common.dataplane.shm_segment import PoolSegment, check_fits, dead_segments, sweep_dead_segments
from common.run.slot_layout import SlotLayout, format_bytes
from common.dataplane.transport_info import (choose_transport, cuda_ipc_transport_info, nixl_transport_info, probe_cuda_host,
                                   shm_transport_info)

log = logging.getLogger("hsd.dispatcher")


class DataPlane:
    def __init__(self, kind: str, layout: SlotLayout, num_slots: int, arena: PoolSegment | None, *,
                 run_id: str = "", node: str = ""):
        self.kind = kind
        self.run_id = run_id
        self.node = node  # the dispatcher's own node: with shm and cuda_ipc every worker must be on it
        self.layout = layout
        self.num_slots = num_slots
        self.arena = arena

    @classmethod
    def create(cls, layout: SlotLayout, pool: PoolSection, *, target: TargetSection, drafter: DrafterSection,
               nodes: NodesSection, run_id: str) -> "DataPlane":
        """The run's data plane for slots of ``layout``: the transport ``pool.transport`` chooses, on
        the GPUs of the ``target`` and ``drafter`` sections, served from node ``nodes.name``."""
        cuda = probe_cuda_host() if pool.transport in ("auto", "cuda_ipc") else None
        kind, reason = choose_transport(pool.transport, same_node=True, cuda=cuda,
                                        target_gpus=target.gpus[:target.count * target.tp_size:target.tp_size],
                                        drafter_gpus=drafter.gpus[:drafter.count])
        if pool.transport == "auto":
            log.info("pool.transport=auto chose %s: %s", kind, reason)
        node = nodes.name or socket.gethostname()
        swept = sweep_dead_segments(run_id)  # this run's, left by a killed dispatcher of it
        if swept:
            log.info("removed %d shared-memory segment(s) a dead dispatcher of this run left: %s", len(swept),
                     ", ".join(swept))
        others = dead_segments()  # another run's belong to it: named, not removed
        if others:
            log.warning("%d shared-memory segment(s) of other runs outlived their dispatchers (%s in %s): "
                        "`hsd cleanup --all-dead` removes them", len(others),
                        format_bytes(sum(s.nbytes for s in others)), ", ".join(s.name for s in others))
        if kind == "shm":
            check_fits(pool.slots, layout.slot_bytes)
            arena = PoolSegment(run_id, layout, pool.slots)
            return cls(kind, layout, pool.slots, arena, run_id=run_id, node=node)
        per_target = max(2, -(-pool.slots // max(1, target.count)))
        return cls(kind, layout, per_target, None, run_id=run_id, node=node)

    @property
    def shared_slots(self) -> int:
        """Slots in memory the dispatcher owns (the arena); cuda_ipc slots arrive with their targets."""
        return self.num_slots if self.arena is not None else 0

    def info(self, role: str, node: str) -> TransportInfo:
        """The register reply's transport descriptor for a worker of ``node``."""
        if self.arena is not None:
            return shm_transport_info(self.arena)
        if self.kind == "nixl":
            return nixl_transport_info(self.layout, self.num_slots, self.run_id, node)
        return cuda_ipc_transport_info(self.layout, self.num_slots)

    def check_worker(self, request: Register) -> None:
        """Refuse a worker whose slot layout differs from the run's, or one of another node when the
        slots cannot leave the dispatcher's."""
        node, role = request.node, request.role
        if self.kind != "nixl" and node is not None and node != self.node:
            raise ProtocolError(ErrorCode.INCOMPATIBLE,
                                f"{role} on node {node!r}, but pool.transport={self.kind} keeps every slot on the "
                                f"dispatcher's node {self.node!r}: runs across nodes need pool.transport=nixl")
        if request.layout is not None and request.layout != self.layout:
            raise ProtocolError(ErrorCode.INCOMPATIBLE, f"capture contract differs: worker has "
                                                        f"{request.layout.to_dict()}, run has {self.layout.to_dict()}")

    def view(self) -> TransportView:
        """The transport as ``hsd stats`` shows it."""
        slot_bytes = self.layout.slot_bytes
        return TransportView(kind=self.kind, slot_bytes=slot_bytes, num_slots=self.num_slots,
                             pool_bytes=slot_bytes * self.num_slots, per_target=self.kind in ("cuda_ipc", "nixl"))

    def describe(self) -> str:
        v = self.view()
        scope = " per target" if v.per_target else ""
        return f"{v.kind} transport, {v.num_slots} slots{scope} x {v.slot_bytes / 2**20:.1f} MiB"

    def close(self) -> None:
        if self.arena is not None:
            self.arena.unlink()
            self.arena = None
