"""Save a trained drafter as a Hugging Face-style directory that serving engines load as is.

Layout (that of the published DFlash checkpoints): ``config.json`` is a Qwen3 config of the draft
layers plus ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
``dflash_config: {target_layer_ids, mask_token_id}``; ``model.safetensors`` holds the draft tensors
only (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``) — the embedding and the LM head are the
target's. Optimizer, scheduler and data position are training state, saved elsewhere (a run's
checkpoint keeps them beside this directory, never inside it: see :mod:`common.run.witness`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from drafter_worker.dflash.config import DFlashConfig
from drafter_worker.dflash.family import ARCHITECTURE
from drafter_worker.dflash.model import DFlashDraftModel, build_drafter
from drafter_worker.layers import (WEIGHTS_NAME, decoder_export_fields, export_dims, find_drafter_dir,
                                   read_export_config, write_drafter_files)


def export_config(config: DFlashConfig, dtype: str) -> dict:
    return {
        **decoder_export_fields(config.target, architecture=ARCHITECTURE, model_type="qwen3",
                                num_layers=config.num_draft_layers, dtype=dtype),
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * config.num_draft_layers,
        "use_sliding_window": False,
        "block_size": config.block_size,
        "num_target_layers": config.target.num_layers,
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


def save_drafter(model: DFlashDraftModel, out_dir: str | os.PathLike, *, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` (files replaced atomically)."""
    return write_drafter_files(model.draft_state_dict(), export_config(model.config, dtype), out_dir, dtype=dtype)


def config_from_export(doc: dict) -> DFlashConfig:
    dflash = doc.get("dflash_config") or {}
    if ARCHITECTURE not in doc.get("architectures", []) or "target_layer_ids" not in dflash:
        raise ValueError("config.json is not a DFlash drafter's (needs architectures DFlashDraftModel and "
                         "dflash_config.target_layer_ids)")
    training = doc.get("hsd_training") or {}
    block_size = doc.get("block_size") or dflash.get("block_size")
    return DFlashConfig(
        block_size=block_size, num_draft_layers=doc["num_hidden_layers"],
        num_anchors=training.get("num_anchors", 512), gamma=training.get("gamma", 0.0),
        target_layer_ids=list(dflash["target_layer_ids"]), mask_token_id=dflash["mask_token_id"],
        mask_token=dflash.get("mask_token", ""), target=export_dims(doc, num_layers=doc.get("num_target_layers", 0)))


def load_drafter(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike, *,
                 dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDraftModel:
    """An exported drafter (or a checkpoint's step directory) with the target's embedding and LM
    head, in ``dtype`` on ``device``."""
    drafter_dir = find_drafter_dir(drafter_dir)
    config = config_from_export(read_export_config(drafter_dir))
    model = build_drafter(config, target_dir, dtype=dtype)
    with safe_open(str(drafter_dir / WEIGHTS_NAME), framework="pt") as f:
        state = {name: f.get_tensor(name).to(torch.float32) for name in f.keys()}
    model.load_draft_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()
