"""The target model's ``config.json``, read one way for every process that needs its dimensions.

The dispatcher derives the capture contract from it (:mod:`common.run.capture_contract`: architecture,
decoder layers, hidden size), the target checks its loaded model against that, and both drafters
size their layers from it (:class:`TargetDims`: hidden and MLP sizes, heads, vocabulary, RoPE). A
drafter built from other dimensions than the contract's would not train on the captured states, so
there is one reader, one rule for a multimodal wrapper (the language model's ``text_config``) and
one reading of the RoPE keys. No torch here: the dispatcher imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_CONFIG_NAME = "config.json"


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a local model directory, with a clear error when it is not one."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"target model directory {path} does not exist")
    config_path = path / MODEL_CONFIG_NAME
    if not config_path.is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no {MODEL_CONFIG_NAME})")
    try:
        doc = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    return doc


def language_config(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a parsed ``config.json``: multimodal checkpoints (Gemma 3,
    Qwen2.5-VL, ...) keep its shape in ``text_config``; a plain decoder's is the document itself."""
    text = doc.get("text_config")
    return text if isinstance(text, Mapping) else doc


def model_shape(doc: Mapping[str, Any]) -> tuple[str, int, int]:
    """(architecture, decoder layers, hidden size) of a parsed ``config.json``."""
    text = language_config(doc)
    architectures = doc.get("architectures") or []
    architecture = architectures[0] if architectures else str(doc.get("model_type", "unknown"))
    try:
        num_layers, hidden_size = int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"model config of {architecture} has no integer num_hidden_layers and hidden_size: "
                         f"not a decoder-only language model this target can run") from None
    return architecture, num_layers, hidden_size


def rope_scaling_of(doc: Mapping[str, Any]) -> dict | None:
    """A config's RoPE scaling as one dict with ``rope_type`` (None for plain RoPE), from the top-level
    ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5, which holds the base too).
    Which scalings a drafter implements is the drafter's to say
    (:func:`drafter_worker.layers.check_rope_scaling`)."""
    raw = doc.get("rope_scaling") or doc.get("rope_parameters") or {}
    scaling = {key: value for key, value in raw.items() if key not in ("rope_theta", "type")}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}


def rope_theta_of(doc: Mapping[str, Any]) -> float:
    """A config's RoPE base: top-level ``rope_theta`` or ``rope_parameters.rope_theta`` (1e6 when neither)."""
    return float(doc.get("rope_theta") or (doc.get("rope_parameters") or {}).get("rope_theta", 1e6))


@dataclass(frozen=True)
class TargetDims:
    """What a drafter takes from the target's language model: the fused context lives in its hidden
    space and the drafter shares its embedding, so ``hidden_size`` and ``vocab_size`` are binding; the
    rest are the defaults of the draft layers' own shape."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int

    @classmethod
    def from_config(cls, doc: Mapping[str, Any]) -> TargetDims:
        text = language_config(doc)
        try:
            num_heads = text["num_attention_heads"]
            return cls(num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
                       intermediate_size=text["intermediate_size"], num_attention_heads=num_heads,
                       num_key_value_heads=text.get("num_key_value_heads") or num_heads,
                       head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
                       rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=rope_theta_of(text),
                       rope_scaling=rope_scaling_of(text),
                       max_position_embeddings=text.get("max_position_embeddings", 40960),
                       vocab_size=text["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"the target's model config has no {exc.args[0]!r}: a drafter takes its dimensions "
                             f"from it") from None

    @classmethod
    def read(cls, model_dir: str | Path) -> TargetDims:
        """The dimensions in ``model_dir``'s ``config.json``."""
        return cls.from_config(read_model_config(model_dir))
