"""What both drafters (DFlash, EAGLE-3) are built from and written as.

Built from: the RMSNorm, the rotary embedding with the target's scaling, and the SwiGLU MLP of a
Llama/Qwen3 decoder layer, with the parameter names of those architectures (a published checkpoint
loads as is), and the target's token embedding and LM head, read from its safetensors without
loading the rest of the target. Written as: one servable directory, ``config.json`` beside
``model.safetensors``, each replaced atomically and readable by an engine serving as another user
(:func:`write_drafter_files`); each drafter's ``export`` module says what its config holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from common.run.durable import atomic_write
from common.run.config import ConfigError
from common.run.target_config import MODEL_CONFIG_NAME, TargetDims, rope_scaling_of, rope_theta_of
from common.run.witness import servable_dir

# -- layers -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


ROPE_TYPES = ("linear", "llama3")  # the scalings rope_inv_freq implements


def check_rope_scaling(scaling: dict | None) -> dict | None:
    """``scaling`` (:func:`common.run.target_config.rope_scaling_of`) when the drafters' RoPE implements it."""
    if scaling and scaling["rope_type"] not in ROPE_TYPES:
        raise ConfigError(f"the target's RoPE scaling {scaling['rope_type']!r} is not one the drafter implements "
                          f"({', '.join(ROPE_TYPES)})")
    return scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, *, device=None) -> torch.Tensor:
    """Rotary frequencies ``[head_dim / 2]``, with the target's scaling: ``linear`` divides them by
    ``factor``; ``llama3`` divides the low frequencies (wavelengths past
    ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the high ones
    (below ``... / high_freq_factor``) and blends linearly in between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    context = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0 at the low end, 1 at the high
    return inv_freq / factor * (1 - blend) + inv_freq * blend


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., head_dim]`` for integer positions, in the half-split layout of Qwen3."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=positions.device)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, D]``, ``cos/sin [B, T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# -- the target's embedding and LM head -----------------------------------------------------------
# Both drafters keep them frozen; loading the whole target for two tensors would cost its full size
# in host memory, ``safe_open`` reads just these. A tied target has no ``lm_head.weight``: its
# embedding doubles as the head.

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


# -- the servable export ------------------------------------------------------------------------

CONFIG_NAME = MODEL_CONFIG_NAME
WEIGHTS_NAME = "model.safetensors"
SERVABLE_MODE = 0o644  # an engine serving as another user reads both files (whatever the umask)
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def rope_fields(theta: float, scaling: dict | None) -> dict:
    """The exported RoPE keys: ``rope_theta`` and ``rope_scaling`` at the top level (what SGLang and
    transformers 4 read) and ``rope_parameters`` (where transformers 5 and vLLM look)."""
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})}}


DRAFT_DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size")  # what a draft model's layers are built from: none may be zero


def draft_dims(target_dir: str | os.PathLike) -> TargetDims:
    """The dimensions of the target at ``target_dir`` that a draft model takes, its RoPE scaling checked."""
    dims = TargetDims.read(target_dir)
    return dataclasses.replace(dims, rope_scaling=check_rope_scaling(dims.rope_scaling))


def check_dims(dims: TargetDims, family: str) -> None:
    for key in DRAFT_DIMS:
        if getattr(dims, key) <= 0:
            raise ConfigError(f"{family} {key} must be positive, got {getattr(dims, key)}")
    if dims.num_attention_heads % dims.num_key_value_heads:
        raise ConfigError(f"num_attention_heads ({dims.num_attention_heads}) must be a multiple of "
                          f"num_key_value_heads ({dims.num_key_value_heads})")


def decoder_export_fields(dims: TargetDims, *, architecture: str, model_type: str, num_layers: int,
                          dtype: str) -> dict:
    """The keys of an exported drafter's ``config.json`` that both drafters write alike: a decoder of
    ``num_layers`` SwiGLU layers with the draft model's dimensions (``dims``: the target's, which a
    DFlash or EAGLE-3 model config holds), its RoPE, and no head of its own to tie (the target's LM
    head is used). :func:`export_dims` reads them back."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": dims.rms_norm_eps,
        **rope_fields(dims.rope_theta, dims.rope_scaling),
        "max_position_embeddings": dims.max_position_embeddings,
        "vocab_size": dims.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def export_dims(doc: dict, *, num_layers: int) -> TargetDims:
    """The dimensions an exported ``config.json`` records (:func:`decoder_export_fields`), with the
    target's decoder layers ``num_layers`` (0 when the export does not say)."""
    return TargetDims(num_layers=num_layers, hidden_size=doc["hidden_size"], intermediate_size=doc["intermediate_size"],
                      num_attention_heads=doc["num_attention_heads"], num_key_value_heads=doc["num_key_value_heads"],
                      head_dim=doc["head_dim"], rms_norm_eps=doc["rms_norm_eps"], rope_theta=rope_theta_of(doc),
                      rope_scaling=check_rope_scaling(rope_scaling_of(doc)),
                      max_position_embeddings=doc.get("max_position_embeddings", 40960), vocab_size=doc["vocab_size"])


def write_drafter_files(tensors: dict[str, torch.Tensor], config_doc: dict, out_dir: str | os.PathLike, *,
                        dtype: str) -> Path:
    """``config.json`` + ``model.safetensors`` (floating tensors cast to ``dtype``, integer and bool
    tensors as they are) into ``out_dir``, each file replaced atomically."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", EXPORT_DTYPES[dtype] if t.is_floating_point() else t.dtype).contiguous()
               for name, t in tensors.items()}
    atomic_write(out_dir / WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
                 mode=SERVABLE_MODE)
    atomic_write(out_dir / CONFIG_NAME, json.dumps(config_doc, indent=2) + "\n", mode=SERVABLE_MODE)
    return out_dir


def find_drafter_dir(path: str | os.PathLike) -> Path:
    """The exported drafter at ``path``: the directory itself, or the servable part of a run's
    step directory (``step-NNNNNNNN/model``)."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file() and (servable_dir(path) / CONFIG_NAME).is_file():
        return servable_dir(path)
    if not (path / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"drafter directory {path} has no {CONFIG_NAME} (give an exported drafter "
                                f"directory or a checkpoint's step directory)")
    return path


def read_export_config(drafter_dir: str | os.PathLike) -> dict:
    """The ``config.json`` of an exported drafter's directory."""
    return json.loads((Path(drafter_dir) / CONFIG_NAME).read_text())
