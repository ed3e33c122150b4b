"""Save a trained EAGLE-3 drafter in the layout vLLM and SGLang load for EAGLE-3.

``config.json`` is a one-layer Llama config plus ``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size`` (``vocab_size`` stays the target's) and the captured layers in each engine's
convention: vLLM uses ``eagle_aux_hidden_state_layer_ids`` (top level) as ``hidden_states`` indices,
layer i's output being index i + 1; SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids``
as layer ids and adds 1 itself. ``model.safetensors`` holds ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t`` and ``t2d``, no embedding (the engines share the target's).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from drafter_worker.eagle3.config import Eagle3Config
from drafter_worker.eagle3.family import ARCHITECTURE
from drafter_worker.eagle3.model import Eagle3DraftModel, build_drafter
from drafter_worker.layers import (WEIGHTS_NAME, decoder_export_fields, export_dims, read_export_config,
                                   write_drafter_files)


def export_config(config: Eagle3Config, dtype: str) -> dict:
    return {
        **decoder_export_fields(config.target, architecture=ARCHITECTURE, model_type="llama", num_layers=1,
                                dtype=dtype),
        "mlp_bias": False,
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": list(config.target_layer_ids)},
        # What this project trains and evaluates with; engines ignore it.
        "hsd_training": {"target_layer_ids": list(config.target_layer_ids),
                         "num_target_layers": config.target.num_layers,
                         "ttt_steps": config.ttt_steps, "loss_decay": config.loss_decay},
    }


def save_drafter(model: Eagle3DraftModel, out_dir: str | os.PathLike, *, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` (``d2t``/``t2d`` keep their dtypes)."""
    return write_drafter_files(model.draft_state_dict(), export_config(model.config, dtype), out_dir, dtype=dtype)


def config_from_export(doc: dict) -> Eagle3Config:
    training = doc.get("hsd_training") or {}
    if ARCHITECTURE not in doc.get("architectures", []) or "target_layer_ids" not in training:
        raise ValueError(f"config.json is not an EAGLE-3 drafter of this project's (needs architectures "
                         f"{ARCHITECTURE} and hsd_training.target_layer_ids)")
    return Eagle3Config(
        target_layer_ids=list(training["target_layer_ids"]), ttt_steps=training["ttt_steps"],
        loss_decay=training["loss_decay"], draft_vocab=doc["draft_vocab_size"],
        target=export_dims(doc, num_layers=training["num_target_layers"]))


def load_drafter(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike, *,
                 dtype: torch.dtype = torch.float32, device="cpu") -> Eagle3DraftModel:
    """An exported drafter with the target's embedding, in ``dtype`` on ``device``."""
    drafter_dir = Path(drafter_dir)
    config = config_from_export(read_export_config(drafter_dir))
    with safe_open(str(drafter_dir / WEIGHTS_NAME), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    for name in ("d2t", "t2d"):
        if name not in state:
            raise ValueError(f"{drafter_dir / WEIGHTS_NAME} has no {name} tensor: not an EAGLE-3 drafter")
    model, _ = build_drafter(config, target_dir, d2t=state["d2t"], t2d=state["t2d"], dtype=dtype)
    model.load_draft_state_dict({k: v if k in ("d2t", "t2d") else v.to(torch.float32) for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval()
