"""Save a trained drafter as a Hugging Face-style directory that serving engines load as is.

Layout (that of the published DFlash checkpoints): ``config.json`` is a Qwen3 config of the draft
layers plus ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
``dflash_config: {target_layer_ids, mask_token_id}``; ``model.safetensors`` holds the draft tensors
only (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``) — the embedding and the LM head are the
target's. Optimizer, scheduler and data position are training state, saved elsewhere (a run's
checkpoint keeps them beside this directory, never inside it: see :mod:`common.witness`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.durable import atomic_write
from common.witness import servable_dir
from drafter_worker.dflash.config import DFlashConfig, rope_fields, rope_scaling_of, rope_theta_of
from drafter_worker.dflash.model import DFlashDraftModel, build_drafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SERVABLE_MODE = 0o644  # an engine serving as another user reads both files (whatever the umask)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_config(config: DFlashConfig, dtype: str) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_draft_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps,
        **rope_fields(config.rope_theta, config.rope_scaling),
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,  # the drafter has no head of its own to tie
        "layer_types": ["full_attention"] * config.num_draft_layers,
        "use_sliding_window": False,
        "torch_dtype": dtype,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
            # Some SGLang versions find the mask by its text alone (default "<|MASK|>"): name it too.
            **({"mask_token": config.mask_token} if config.mask_token else {}),
            "block_size": config.block_size,
        },
        # Training-only knobs, kept so that a reload trains on the same way; engines ignore them.
        "hsd_training": {"gamma": config.gamma, "num_anchors": config.num_anchors},
    }


def write_drafter_files(tensors: dict[str, torch.Tensor], config_doc: dict, out_dir: str | os.PathLike, *,
                        dtype: str) -> Path:
    """``config.json`` + ``model.safetensors`` (floating tensors cast to ``dtype``, integer and bool
    tensors as they are) into ``out_dir``, each file replaced atomically."""
    if dtype not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", _DTYPES[dtype] if t.is_floating_point() else t.dtype).contiguous()
               for name, t in tensors.items()}
    atomic_write(out_dir / WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
                 mode=SERVABLE_MODE)
    atomic_write(out_dir / CONFIG_NAME, json.dumps(config_doc, indent=2) + "\n", mode=SERVABLE_MODE)
    return out_dir


def save_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, *, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` (files replaced atomically)."""
    return write_drafter_files(model.draft_state_dict(), export_config(model.config, dtype), out_dir, dtype=dtype)


def config_from_export(doc: dict) -> DFlashConfig:
    dflash = doc.get("dflash_config") or {}
    if "DFlashDraftModel" not in doc.get("architectures", []) or "target_layer_ids" not in dflash:
        raise ValueError("config.json is not a DFlash drafter's (needs architectures DFlashDraftModel and "
                         "dflash_config.target_layer_ids)")
    training = doc.get("hsd_training") or {}
    block_size = doc.get("block_size") or dflash.get("block_size")
    return DFlashConfig(
        block_size=block_size, num_draft_layers=doc["num_hidden_layers"],
        num_anchors=training.get("num_anchors", 512), gamma=training.get("gamma", 0.0),
        target_layer_ids=list(dflash["target_layer_ids"]), num_target_layers=doc.get("num_target_layers", 0),
        mask_token_id=dflash["mask_token_id"], hidden_size=doc["hidden_size"],
        intermediate_size=doc["intermediate_size"], num_attention_heads=doc["num_attention_heads"],
        num_key_value_heads=doc["num_key_value_heads"], head_dim=doc["head_dim"],
        rms_norm_eps=doc["rms_norm_eps"], rope_theta=rope_theta_of(doc), rope_scaling=rope_scaling_of(doc),
        mask_token=dflash.get("mask_token", ""),
        max_position_embeddings=doc.get("max_position_embeddings", 40960), vocab_size=doc["vocab_size"])


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


def load_drafter(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike, *,
                 dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDraftModel:
    """An exported drafter (or a checkpoint's step directory) with the target's embedding and LM
    head, in ``dtype`` on ``device``."""
    drafter_dir = find_drafter_dir(drafter_dir)
    config_path = drafter_dir / CONFIG_NAME
    config = config_from_export(json.loads(config_path.read_text()))
    model = build_drafter(config, target_dir, dtype=dtype)
    with safe_open(str(drafter_dir / WEIGHTS_NAME), framework="pt") as f:
        state = {name: f.get_tensor(name).to(torch.float32) for name in f.keys()}
    model.load_draft_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()
