"""Which hidden-state transport a run uses, and the ``transport`` map of the register reply.

Torch-free: the dispatcher decides and describes the data plane but never touches a tensor. Only
``pool.transport=auto`` on a host that has an NVIDIA device node asks torch whether CUDA works.
"""

from __future__ import annotations

import glob
import importlib.util
import sys
from typing import Any

from common.slot_layout import SlotLayout

TRANSPORT_KINDS = ("shm", "cuda_ipc", "nixl")
# The meta package ``nixl`` picks a CUDA build; the builds themselves work as well without it.
ENGINE_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
INSTALL_HINT = "pip install 'hsdispatch[multinode]' (NIXL)"


def engine_missing() -> str | None:
    """None when NIXL can be imported here, else what to install; imports nothing (no torch)."""
    if any(importlib.util.find_spec(name) is not None for name in ENGINE_MODULES):
        return None
    return f"pool.transport=nixl (runs across nodes) needs NIXL, which is not installed here: {INSTALL_HINT}"
TRANSPORT_CHOICES = ("auto",) + TRANSPORT_KINDS


def cuda_ipc_possible() -> bool:
    """Whether CUDA IPC can work here, asking torch only on a host with an NVIDIA device node
    (importing torch costs a dispatcher seconds at start)."""
    if not sys.platform.startswith("linux") or not glob.glob("/dev/nvidia[0-9]*"):
        return False
    from common.cuda_ipc import cuda_ipc_available
    return cuda_ipc_available()


def resolve_transport(requested: str, same_node: bool, *, cuda_available: bool | None = None) -> str:
    """``pool.transport`` -> the kind to use: auto picks cuda_ipc for local CUDA workers, else shm."""
    if requested not in TRANSPORT_CHOICES:
        raise ValueError(f"pool.transport: {requested!r} is not one of {', '.join(TRANSPORT_CHOICES)}")
    if requested == "shm":
        return "shm"
    if requested == "nixl":
        missing = engine_missing()
        if missing:
            raise ValueError(missing)
        return "nixl"
    if cuda_available is None:
        cuda_available = cuda_ipc_possible()
    if requested == "cuda_ipc":
        if not cuda_available:
            raise ValueError("pool.transport=cuda_ipc needs CUDA on Linux, and this host has none; "
                             "use pool.transport=shm (or auto)")
        if not same_node:
            raise ValueError("pool.transport=cuda_ipc needs every worker on the dispatcher's node")
        return "cuda_ipc"
    return "cuda_ipc" if cuda_available and same_node else "shm"


def shm_transport_info(arena: Any) -> dict[str, Any]:
    """For a pool segment (or a mapped SlotArena): its name, slot count and layout."""
    return {"kind": "shm", "arena": arena.name, "num_slots": arena.num_slots, "layout": arena.layout.to_dict()}


def cuda_ipc_transport_info(layout: SlotLayout, num_slots: int) -> dict[str, Any]:
    """``num_slots`` is what each target allocates on its GPU (its share of the pool)."""
    return {"kind": "cuda_ipc", "num_slots": num_slots, "layout": layout.to_dict()}


def nixl_transport_info(layout: SlotLayout, num_slots: int, run_id: str) -> dict[str, Any]:
    """``num_slots`` is what each target allocates on its node; ``run_id`` names its segment."""
    return {"kind": "nixl", "num_slots": num_slots, "layout": layout.to_dict(), "run_id": run_id}


def parse_transport_info(info: dict[str, Any]) -> tuple[str, SlotLayout, int]:
    kind = info.get("kind")
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"unknown transport kind {kind!r} (known: {', '.join(TRANSPORT_KINDS)})")
    num_slots = info.get("num_slots")
    if not isinstance(num_slots, int) or num_slots <= 0:
        raise ValueError(f"transport info needs a positive num_slots, got {num_slots!r}")
    if kind == "shm" and not isinstance(info.get("arena"), str):
        raise ValueError("shm transport info needs the arena name")
    if kind == "nixl" and not (isinstance(info.get("run_id"), str) and isinstance(info.get("node"), str)):
        raise ValueError("nixl transport info needs the run id and the worker's node")
    return kind, SlotLayout.from_dict(info["layout"]), num_slots
