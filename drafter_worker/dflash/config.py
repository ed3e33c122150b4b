"""Configs of the DFlash drafter: the model's shape (:class:`DFlashConfig`: the ``dflash`` section's
model keys and the dimensions read from the target) and how it trains (:class:`DFlashTrainConfig`,
the run's ``dflash`` config section with its total steps resolved).

The draft layers are Qwen3-style decoder layers whose dimensions default to the target's own
(read from the target directory's ``config.json``): the fused context lives in the target's hidden
space and the drafter reuses the target's embedding and LM head, so ``hidden_size`` and
``vocab_size`` must match the target; the other dimensions could differ but rarely should.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from common.config import ConfigError, DFlashModelKeys, DFlashSection, model_keys, opt
from drafter_worker.recipe import validate_recipe

# Loss decay gamma per block size, as published with the method; other block sizes need an explicit gamma.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ConfigError(f"no default loss decay gamma for block_size {block_size} "
                          f"(known: {sorted(DEFAULT_GAMMA)}): set gamma explicitly")
    return DEFAULT_GAMMA[block_size]


def read_target_config(target_dir: str | Path) -> dict:
    """The target's language-model config (``config.json``; a multimodal wrapper's ``text_config``)."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"target directory {target_dir} has no config.json")
    target = json.loads(path.read_text())
    return target.get("text_config", target)  # multimodal wrappers keep the language model's config inside


_ROPE_TYPES = ("linear", "llama3")  # the scalings the drafters' RoPE implements (drafter_worker.dflash.model)


def rope_scaling_of(doc: dict) -> dict | None:
    """A config's RoPE scaling as one dict with ``rope_type`` (None for plain RoPE), from the top-level
    ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5, which holds the base too)."""
    raw = doc.get("rope_scaling") or doc.get("rope_parameters") or {}
    scaling = {key: value for key, value in raw.items() if key not in ("rope_theta", "type")}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"the target's RoPE scaling {rope_type!r} is not one the drafter implements "
                          f"({', '.join(_ROPE_TYPES)})")
    return {**scaling, "rope_type": rope_type}


def rope_theta_of(doc: dict) -> float:
    """A config's RoPE base: top-level ``rope_theta`` or ``rope_parameters.rope_theta`` (1e6 when neither)."""
    return float(doc.get("rope_theta") or (doc.get("rope_parameters") or {}).get("rope_theta", 1e6))


def rope_fields(theta: float, scaling: dict | None) -> dict:
    """The exported RoPE keys: ``rope_theta`` and ``rope_scaling`` at the top level (what SGLang and
    transformers 4 read) and ``rope_parameters`` (where transformers 5 and vLLM look)."""
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})}}


@dataclass
class DFlashConfig(DFlashModelKeys):
    """The draft model: the ``dflash`` section's model keys (block_size, num_draft_layers, num_anchors,
    gamma, mask_token_id: declared once, in :class:`common.config.DFlashModelKeys`) and what is read
    from the target (:meth:`from_target`) or an export."""
    target_layer_ids: list[int] = opt([], "Target layers whose outputs are fused (layer i = the raw output of decoder layer i, before any final norm).")
    num_target_layers: int = opt(0, "Decoder layers of the target (exported for serving engines).")
    hidden_size: int = opt(0, "Hidden size (must equal the target's).")
    intermediate_size: int = opt(0, "SwiGLU inner size of the draft layers.")
    num_attention_heads: int = opt(0, "Query heads of the draft layers.")
    num_key_value_heads: int = opt(0, "Key/value heads of the draft layers (grouped-query attention).")
    head_dim: int = opt(0, "Size of one attention head.")
    rms_norm_eps: float = opt(1e-6, "Epsilon of every RMSNorm.")
    rope_theta: float = opt(1e6, "RoPE base.")
    rope_scaling: dict | None = opt(None, "The target's RoPE scaling (rope_type linear or llama3 and its keys); None = plain RoPE.")
    mask_token: str = opt("", "Text of the mask token (exported beside its id for engines that look the id up by it); empty = unknown.")
    max_position_embeddings: int = opt(40960, "Longest position the model is configured for (exported as is).")
    vocab_size: int = opt(0, "Vocabulary size (must equal the target's).")

    def __post_init__(self) -> None:
        if self.gamma == 0.0:
            self.gamma = default_gamma(self.block_size)
        # A run resolves mask_token_id -1 from the tokenizer (drafter_worker.dflash.mask_token) before it
        # builds the model; here, for a model built directly (tests and benches on random tokens), -1 is
        # the embedding's last row.
        if self.mask_token_id == -1 and self.vocab_size > 0:
            self.mask_token_id = self.vocab_size - 1
        self.validate()

    def validate(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2 (the anchor plus one drafted token), got {self.block_size}")
        for key in ("num_draft_layers", "num_anchors", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"dflash {key} must be positive, got {getattr(self, key)}")
        if not math.isfinite(self.gamma) or self.gamma <= 0:
            raise ConfigError(f"dflash gamma must be a positive number, got {self.gamma}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.target_layer_ids:
            raise ConfigError("dflash target_layer_ids is empty: name the captured target layers")
        if self.num_target_layers and not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids {self.target_layer_ids} out of range for a target with "
                              f"{self.num_target_layers} layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is not a row of the target embedding "
                              f"(vocab_size {self.vocab_size})")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_dir: str | Path, *, layer_ids: list[int], **overrides) -> "DFlashConfig":
        """Draft dimensions from the target's ``config.json``; ``overrides`` set any field."""
        target = read_target_config(target_dir)
        num_heads = target["num_attention_heads"]
        fields = dict(
            target_layer_ids=list(layer_ids),
            num_target_layers=target["num_hidden_layers"],
            hidden_size=target["hidden_size"],
            intermediate_size=target["intermediate_size"],
            num_attention_heads=num_heads,
            num_key_value_heads=target.get("num_key_value_heads") or num_heads,
            head_dim=target.get("head_dim") or target["hidden_size"] // num_heads,
            rms_norm_eps=target.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(target),
            rope_scaling=rope_scaling_of(target),
            max_position_embeddings=target.get("max_position_embeddings", 40960),
            vocab_size=target["vocab_size"],
        )
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown DFlash config keys: {', '.join(sorted(unknown))}")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)


@dataclass
class DFlashTrainConfig(DFlashSection):
    """The ``dflash`` config section as the trainer takes it. Its keys, defaults and help lines are
    the section's own (declared once, in :class:`common.config.DFlashSection`); what this adds is what a
    training run needs beyond a loadable config: ``total_steps`` resolved to a positive count (the
    section's 0 means "derive it from the run", which :mod:`drafter_worker.dflash_backend` does) and
    the optimizer values checked before a model is built."""

    @classmethod
    def from_section(cls, section: DFlashSection, *, total_steps: int) -> "DFlashTrainConfig":
        """The run's ``dflash`` section with its total steps resolved."""
        return cls(**{**dataclasses.asdict(section), "total_steps": total_steps})

    def validate(self) -> None:
        validate_recipe("dflash", self)

    def model_config(self, target_dir: str | Path, layer_ids: list[int]) -> DFlashConfig:
        """The draft model of this section's model keys on the target at ``target_dir``."""
        return DFlashConfig.from_target(target_dir, layer_ids=layer_ids, **model_keys(DFlashModelKeys, self))
