"""Save a training state (nested dicts and lists of tensors and plain values) without pickle.

The tensors go to one safetensors file (``state.safetensors``), the structure around them to
``state.json``, where a tensor is ``{"__tensor__": name}``, a dict whose keys are not all strings
(an optimizer's per-parameter state is keyed by int) is ``{"__items__": [[key, value], ...]}`` and a
tuple is ``{"__tuple__": [...]}``. Loading never executes anything it reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.run.checkpoint_manifest import reading
from common.run.durable import atomic_write

TENSORS_NAME = "state.safetensors"
STRUCTURE_NAME = "state.json"


def flatten_state(value, tensors: dict[str, torch.Tensor], *, host: bool = True):
    """``value``'s structure, its tensors moved to ``tensors`` (named ``t0``, ``t1``, ...): contiguous
    on the host, or with ``host=False`` the state's own tensors where they are (the caller copies them)."""
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().to("cpu").contiguous() if host else value.detach()
        return {"__tensor__": name}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: flatten_state(v, tensors, host=host) for k, v in value.items()}
        return {"__items__": [[k, flatten_state(v, tensors, host=host)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [flatten_state(v, tensors, host=host) for v in value]}
    if isinstance(value, list):
        return [flatten_state(v, tensors, host=host) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot save a value of type {type(value).__name__} in a training state")


def unflatten_state(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__items__" in value:
            return {k: unflatten_state(v, tensors) for k, v in value["__items__"]}
        if "__tuple__" in value:
            return tuple(unflatten_state(v, tensors) for v in value["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [unflatten_state(v, tensors) for v in value]
    return value


def save_state(state: dict, out_dir: str | os.PathLike) -> Path:
    """Write ``state`` into ``out_dir`` (both files replaced atomically, structure last)."""
    tensors: dict[str, torch.Tensor] = {}
    return write_state(flatten_state(state, tensors), tensors, out_dir)


def write_state(structure, tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike) -> Path:
    """Write a flattened state (:func:`flatten_state`) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / TENSORS_NAME,
                 lambda tmp: save_file({name: t.to("cpu").contiguous() for name, t in tensors.items()}, str(tmp)))
    atomic_write(out_dir / STRUCTURE_NAME, json.dumps(structure))
    return out_dir


def load_state(state_dir: str | os.PathLike) -> dict:
    """The state :func:`save_state` wrote; a file that is missing or does not parse raises
    :class:`common.run.checkpoint_manifest.DamagedCheckpoint` naming it."""
    state_dir = Path(state_dir)
    if not (state_dir / STRUCTURE_NAME).is_file():
        raise FileNotFoundError(f"{state_dir} holds no training state ({STRUCTURE_NAME} missing)")
    with reading(state_dir / TENSORS_NAME):
        tensors = load_file(str(state_dir / TENSORS_NAME))
    with reading(state_dir / STRUCTURE_NAME):
        return unflatten_state(json.loads((state_dir / STRUCTURE_NAME).read_text()), tensors)
