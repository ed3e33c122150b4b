"""Configs of the DFlash drafter: the model's shape (:class:`DFlashConfig`: the ``dflash`` section's
model keys and the dimensions read from the target) and how it trains (:class:`DFlashTrainConfig`,
the run's ``dflash`` config section with its total steps resolved).

The draft layers are Qwen3-style decoder layers whose dimensions default to the target's own
(its ``config.json``, read by :class:`common.run.target_config.TargetDims`): the fused context lives in
the target's hidden space and the drafter reuses the target's embedding and LM head, so
``hidden_size`` and ``vocab_size`` must match the target; the other dimensions could differ but
rarely should.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from common.run.config import ConfigError, opt
from common.run.target_config import TargetDims
from drafter_worker.dflash.section import DFlashModelKeys, DFlashSection
from drafter_worker.layers import check_rope_scaling
from drafter_worker.train_section import TrainSection

# Loss decay gamma per block size, as published with the method; other block sizes need an explicit gamma.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ConfigError(f"no default loss decay gamma for block_size {block_size} "
                          f"(known: {sorted(DEFAULT_GAMMA)}): set gamma explicitly")
    return DEFAULT_GAMMA[block_size]


@dataclass
class DFlashConfig(DFlashModelKeys):
    """The draft model: the ``dflash`` section's model keys (block_size, num_draft_layers, num_anchors,
    gamma, mask_token_id: declared once, in :class:`drafter_worker.dflash.section.DFlashModelKeys`) and what is read
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
        target = TargetDims.read(target_dir)
        fields = dict(
            target_layer_ids=list(layer_ids),
            num_target_layers=target.num_layers,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=check_rope_scaling(target.rope_scaling),
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size,
        )
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown DFlash config keys: {', '.join(sorted(unknown))}")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)


@dataclass
class DFlashTrainConfig(TrainSection, DFlashSection):
    """The ``dflash`` config section as the trainer takes it. Its keys, defaults and help lines are
    the section's own (declared once, in :class:`drafter_worker.dflash.section.DFlashSection`); what this adds is what a
    training run needs beyond a loadable config: ``total_steps`` resolved to a positive count (the
    section's 0 means "derive it from the run", which :mod:`drafter_worker.drafter_backend` does) and
    the optimizer values checked before a model is built."""

    SECTION = "dflash"
    MODEL_KEYS = DFlashModelKeys
    MODEL_CONFIG = DFlashConfig

