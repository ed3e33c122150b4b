"""The data plane's descriptors: what the dispatcher tells a worker of the run's slots, and what a
target tells the dispatcher (and, through it, every drafter) of the slots it owns.

Both are tagged unions on ``kind`` (``shm``, ``cuda_ipc``, ``nixl``), sent as msgpack maps inside the
control messages (:mod:`common.wire.messages`) and decoded with them: a missing field, a value of the
wrong type or an unknown kind is refused there, as a ``ValidationError`` naming its path. The data
plane (:mod:`common.dataplane`) builds and opens them, the wire only carries them: both stand on this
module, which imports neither.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from common.run.slot_layout import SlotLayout

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


class Descriptor(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    @property
    def kind(self) -> str:
        """The transport this describes (the ``kind`` field on the wire)."""
        return type(self).__struct_config__.tag


# -- the register reply's ``transport``: how a worker opens the run's slots -------------------------

class ShmInfo(Descriptor, tag="shm", frozen=True, kw_only=True):
    """Every slot in the dispatcher's shared-memory pool, which each worker maps."""
    arena: str  # the pool segment's name
    num_slots: PositiveInt
    layout: SlotLayout


class CudaIpcInfo(Descriptor, tag="cuda_ipc", frozen=True, kw_only=True):
    """Each target allocates ``num_slots`` (its share of the pool) on its GPU and exports them."""
    num_slots: PositiveInt
    layout: SlotLayout


class NixlInfo(Descriptor, tag="nixl", frozen=True, kw_only=True):
    """Each target allocates ``num_slots`` in its node's memory, in a segment named for ``run_id``."""
    num_slots: PositiveInt
    layout: SlotLayout
    run_id: str
    node: str  # the worker's own node: its slots (a target) or the slots it reads locally (a drafter)


TransportInfo = Union[ShmInfo, CudaIpcInfo, NixlInfo]


# -- a target's ``register_slots`` (and each job of its slots): how a drafter opens them ------------

class CudaIpcExport(Descriptor, tag="cuda_ipc", frozen=True, kw_only=True):
    """One dedicated CUDA allocation holding all of a target's slots, as torch shares storage (no pickle)."""
    block_id: str
    host: str
    pid: int
    device_index: int
    device_uuid: str | None = None
    handle: bytes
    storage_bytes: int
    storage_offset: int
    num_slots: PositiveInt
    slot_bytes: PositiveInt


class NixlExport(Descriptor, tag="nixl", frozen=True, kw_only=True):
    """A target's slots in a segment of its node's shared memory, registered with its NIXL agent."""
    node: str
    arena: str  # the segment's name
    agent: str
    metadata: bytes  # the agent's, for a remote reader to add it
    base: int  # the block's address in the owner's process
    nbytes: int


SlotExport = Union[CudaIpcExport, NixlExport]
