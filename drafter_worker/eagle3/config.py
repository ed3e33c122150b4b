"""Configs of the EAGLE-3 drafter: the model's shape (:class:`Eagle3Config`: the ``eagle3`` section's
model keys and the target's dimensions) and how it trains (:class:`Eagle3TrainConfig`, the run's
``eagle3`` section with its total steps resolved).

The one decoder layer is Llama-shaped with the target's dimensions (its ``config.json``, read by
:class:`common.run.target_config.TargetDims`): its attention reads ``2 × hidden`` features (the token
embedding beside the fused hidden state), the target's embedding is shared and frozen, and the LM
head is the drafter's own, over the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.run.config import ConfigError, opt
from common.run.target_config import TargetDims
from drafter_worker.eagle3.family import NUM_FUSED_LAYERS
from drafter_worker.eagle3.section import Eagle3ModelKeys, Eagle3Section
from drafter_worker.layers import check_rope_scaling
from drafter_worker.train_section import TrainSection


@dataclass
class Eagle3Config(Eagle3ModelKeys):
    """The draft model: the ``eagle3`` section's model keys (ttt_steps, draft_vocab, loss_decay: declared
    once, in :class:`drafter_worker.eagle3.section.Eagle3ModelKeys`) and the target's dimensions (:meth:`from_target`)."""
    target_layer_ids: list[int] = opt([], "Target layers whose outputs are fused (layer i = the raw output of decoder layer i, before any final norm).")
    num_target_layers: int = opt(0, "Decoder layers of the target.")
    hidden_size: int = opt(0, "Hidden size (the target's).")
    intermediate_size: int = opt(0, "SwiGLU inner size.")
    num_attention_heads: int = opt(0, "Query heads.")
    num_key_value_heads: int = opt(0, "Key/value heads (grouped-query attention).")
    head_dim: int = opt(0, "Size of one attention head.")
    rms_norm_eps: float = opt(1e-6, "Epsilon of every RMSNorm.")
    rope_theta: float = opt(1e6, "RoPE base.")
    rope_scaling: dict | None = opt(None, "The target's RoPE scaling (rope_type linear or llama3 and its keys); None = plain RoPE.")
    max_position_embeddings: int = opt(40960, "Longest position the model is configured for (exported as is).")
    vocab_size: int = opt(0, "The target's vocabulary size.")

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the drafter's LM head scores: draft_vocab, capped at the target's vocabulary."""
        return min(self.draft_vocab, self.vocab_size)

    def __post_init__(self) -> None:
        for key in ("num_target_layers", "ttt_steps", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"eagle3 {key} must be positive, got {getattr(self, key)}")
        if len(self.target_layer_ids) != NUM_FUSED_LAYERS:
            raise ConfigError(f"an EAGLE-3 drafter fuses {NUM_FUSED_LAYERS} target layers, got {self.target_layer_ids}")
        if not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids {self.target_layer_ids} out of range for a target with "
                              f"{self.num_target_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.loss_decay <= 0:
            raise ConfigError(f"eagle3 loss_decay must be positive, got {self.loss_decay}")

    @classmethod
    def from_target(cls, target_dir: str | Path, *, layer_ids: list[int], **overrides) -> "Eagle3Config":
        """Dimensions from the target's ``config.json``; ``overrides`` set any field."""
        target = TargetDims.read(target_dir)
        fields = dict(
            target_layer_ids=list(layer_ids), num_target_layers=target.num_layers,
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            rope_scaling=check_rope_scaling(target.rope_scaling),
            max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
        )
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown EAGLE-3 config keys: {', '.join(sorted(unknown))}")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)


@dataclass
class Eagle3TrainConfig(TrainSection, Eagle3Section):
    """The ``eagle3`` config section as the trainer takes it: ``total_steps`` resolved to a positive count."""

    SECTION = "eagle3"
    MODEL_KEYS = Eagle3ModelKeys
    MODEL_CONFIG = Eagle3Config

