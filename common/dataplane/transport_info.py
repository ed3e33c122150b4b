"""Which hidden-state transport a run uses, and the ``transport`` descriptor of the register reply.

Torch-free: the dispatcher decides and describes the data plane but never touches a tensor. Only
``pool.transport=auto`` (or ``cuda_ipc``) on a host that has an NVIDIA device node asks torch
whether CUDA works and which GPUs can map each other's memory.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence, get_args

from common.run.config import Transport
from common.run.descriptors import CudaIpcInfo, NixlInfo, ShmInfo
from common.run.slot_layout import SlotLayout

TRANSPORT_CHOICES = get_args(Transport)  # pool.transport: auto or a kind
TRANSPORT_KINDS = tuple(choice for choice in TRANSPORT_CHOICES if choice != "auto")
# The meta package ``nixl`` picks a CUDA build; the builds themselves work as well without it.
ENGINE_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
INSTALL_HINT = "pip install 'hsdispatch[multinode]' (NIXL)"


def engine_missing() -> str | None:
    """None when NIXL can be imported here, else what to install; imports nothing (no torch)."""
    if any(importlib.util.find_spec(name) is not None for name in ENGINE_MODULES):
        return None
    return f"pool.transport=nixl (runs across nodes) needs NIXL, which is not installed here: {INSTALL_HINT}"


def cuda_ipc_possible() -> bool:
    """Whether CUDA IPC can work here, asking torch only on a host with an NVIDIA device node
    (importing torch costs a dispatcher seconds at start)."""
    if not sys.platform.startswith("linux") or not glob.glob("/dev/nvidia[0-9]*"):
        return False
    from common.dataplane.cuda_ipc import cuda_ipc_available
    return cuda_ipc_available()


@dataclass(frozen=True)
class CudaHost:
    """What ``auto`` needs to know of this host's CUDA, as the dispatcher sees it.

    ``visible``: the physical GPU ids behind the dispatcher's device indices (its
    ``CUDA_VISIBLE_DEVICES``), None when it sees every GPU by its id. ``can_access_peer(a, b)``:
    whether device index ``a`` can map memory of device index ``b`` (what a drafter on ``a`` opening
    a target's block on ``b`` needs).
    """

    num_devices: int
    can_access_peer: Callable[[int, int], bool]
    visible: tuple[int, ...] | None = None

    def index_of(self, gpu: int) -> int | None:
        """The dispatcher's device index of physical GPU ``gpu`` (``target.gpus`` ids), None if not seen."""
        if self.visible is None:
            index = gpu
        elif gpu in self.visible:
            index = self.visible.index(gpu)
        else:
            return None
        return index if 0 <= index < self.num_devices else None


def probe_cuda_host() -> CudaHost | None:
    """This host's :class:`CudaHost`, or None without CUDA (torch is imported only where CUDA can be)."""
    if not cuda_ipc_possible():
        return None
    import torch
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [part.strip() for part in visible.split(",")] if visible else []
    numeric = tuple(int(i) for i in ids) if ids and all(i.isdigit() for i in ids) else None
    return CudaHost(torch.cuda.device_count(), torch.cuda.can_device_access_peer, numeric)


def choose_transport(requested: str, same_node: bool, *, cuda: CudaHost | None, target_gpus: Sequence[int] = (),
                     drafter_gpus: Sequence[int] = ()) -> tuple[str, str]:
    """``pool.transport`` -> (the kind to use, why). ``target_gpus`` / ``drafter_gpus``: the GPU of each
    worker of the node (a target group's rank 0), empty for workers on the CPU.

    ``auto`` picks cuda_ipc only when every target and every drafter is on a GPU and each drafter's
    GPU can map each target's (peer access, or the same GPU); shm otherwise (pinned where CUDA is).
    """
    if requested not in TRANSPORT_CHOICES:
        raise ValueError(f"pool.transport: {requested!r} is not one of {', '.join(TRANSPORT_CHOICES)}")
    if requested == "shm":
        return "shm", "pool.transport=shm"
    if requested == "nixl":
        missing = engine_missing()
        if missing:
            raise ValueError(missing)
        return "nixl", "pool.transport=nixl"
    if requested == "cuda_ipc":
        if cuda is None:
            raise ValueError("pool.transport=cuda_ipc needs CUDA on Linux, and this host has none; "
                             "use pool.transport=shm (or auto)")
        if not same_node:
            raise ValueError("pool.transport=cuda_ipc needs every worker on the dispatcher's node")
        return "cuda_ipc", "pool.transport=cuda_ipc"
    if cuda is None:
        return "shm", "no CUDA on this host"
    if not same_node:
        return "shm", "workers on other nodes"
    if not target_gpus or not drafter_gpus:
        cpu = [role for role, gpus in (("targets", target_gpus), ("drafters", drafter_gpus)) if not gpus]
        return "shm", f"{' and '.join(cpu)} on the CPU (no target.gpus / drafter.gpus)"
    indices = {}
    for gpu in {*target_gpus, *drafter_gpus}:
        index = cuda.index_of(gpu)
        if index is None:
            return "shm", f"GPU {gpu} is not among the {cuda.num_devices} this host shows the dispatcher"
        indices[gpu] = index
    for d in sorted(set(drafter_gpus)):
        for t in sorted(set(target_gpus)):
            if d != t and not cuda.can_access_peer(indices[d], indices[t]):
                return "shm", f"no peer access from drafter GPU {d} to target GPU {t}"
    return "cuda_ipc", (f"targets on GPUs {sorted(set(target_gpus))}, drafters on GPUs {sorted(set(drafter_gpus))}, "
                        f"peer access between them")


def resolve_transport(requested: str, same_node: bool, *, cuda: CudaHost | None | bool = True,
                      target_gpus: Sequence[int] = (), drafter_gpus: Sequence[int] = ()) -> str:
    """:func:`choose_transport`'s kind; ``cuda=True`` (the default) probes this host."""
    host = probe_cuda_host() if cuda is True else cuda
    return choose_transport(requested, same_node, cuda=host or None, target_gpus=target_gpus,
                            drafter_gpus=drafter_gpus)[0]


def shm_transport_info(arena: Any) -> ShmInfo:
    """For a pool segment (or a mapped SlotArena): its name, slot count and layout."""
    return ShmInfo(arena=arena.name, num_slots=arena.num_slots, layout=arena.layout)


def cuda_ipc_transport_info(layout: SlotLayout, num_slots: int) -> CudaIpcInfo:
    """``num_slots`` is what each target allocates on its GPU (its share of the pool)."""
    return CudaIpcInfo(num_slots=num_slots, layout=layout)


def nixl_transport_info(layout: SlotLayout, num_slots: int, run_id: str, node: str) -> NixlInfo:
    """``num_slots`` is what each target allocates on its node; ``run_id`` names its segment; ``node``
    is the worker's."""
    return NixlInfo(num_slots=num_slots, layout=layout, run_id=run_id, node=node)
