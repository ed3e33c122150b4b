"""Read the target's token embedding and LM head, and nothing else, from its safetensors files.

The drafter shares both with the target and keeps them frozen. Loading the whole target for two
tensors would cost the target's full size in host memory; ``safe_open`` reads just these two.
A target with tied embeddings has no ``lm_head.weight``: its embedding doubles as the head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_SUFFIX = "embed_tokens.weight"
HEAD_NAME = "lm_head.weight"


def _tensor_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, for a single-file or a sharded checkpoint."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"target directory {target_dir} has no model.safetensors "
                                f"(or model.safetensors.index.json)")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding [V, H], lm_head [V, H])`` of the target; the same tensor twice when tied."""
    target_dir = Path(target_dir)
    files = _tensor_files(target_dir)
    embed_names = sorted(n for n in files if n.endswith(EMBED_SUFFIX))
    # Prefer the language model's own table (model.embed_tokens) over e.g. a vision tower's.
    embed_names.sort(key=lambda n: (n != f"model.{EMBED_SUFFIX}", len(n)))
    if not embed_names:
        raise ValueError(f"target {target_dir}: no tensor named *{EMBED_SUFFIX} in its safetensors")
    embed = _read(files[embed_names[0]], embed_names[0])
    head_names = sorted((n for n in files if n == HEAD_NAME or n.endswith("." + HEAD_NAME)), key=len)
    head = _read(files[head_names[0]], head_names[0]) if head_names else embed
    if head.shape != embed.shape:
        raise ValueError(f"target {target_dir}: lm_head {tuple(head.shape)} and embedding "
                         f"{tuple(embed.shape)} differ in shape")
    return embed, head
