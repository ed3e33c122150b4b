"""Configs of the EAGLE-3 drafter: the model's shape (:class:`Eagle3Config`: the ``eagle3`` section's
model keys and the target's dimensions) and how it trains (:class:`Eagle3TrainConfig`, the run's
``eagle3`` section with its total steps resolved).

The one decoder layer is Llama-shaped with the target's dimensions (its ``config.json``, read by
:class:`common.run.target_config.TargetDims`): its attention reads ``2 × hidden`` features (the token
embedding beside the fused hidden state), the target's embedding is shared and frozen, and the LM
head is the drafter's own, over the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.run.config import ConfigError, opt
from common.run.target_config import TargetDims
from drafter_worker.eagle3.family import NUM_FUSED_LAYERS
from drafter_worker.eagle3.section import Eagle3ModelKeys, Eagle3Section
from drafter_worker.layers import check_dims, draft_dims
from drafter_worker.train_section import TrainSection


@dataclass
class Eagle3Config(Eagle3ModelKeys):
    """The draft model: the ``eagle3`` section's model keys (ttt_steps, draft_vocab, loss_decay: declared
    once, in :class:`drafter_worker.eagle3.section.Eagle3ModelKeys`), the target's dimensions
    (:class:`common.run.target_config.TargetDims`, read by :meth:`from_target` or from an export) and
    the captured layers."""
    target: TargetDims = field(kw_only=True)
    target_layer_ids: list[int] = opt([], "Target layers whose outputs are fused (layer i = the raw output of decoder layer i, before any final norm).")

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the drafter's LM head scores: draft_vocab, capped at the target's vocabulary."""
        return min(self.draft_vocab, self.target.vocab_size)

    def __post_init__(self) -> None:
        for owner, key, name in ((self.target, "num_layers", "num_target_layers"), (self, "ttt_steps", "ttt_steps"),
                                 (self, "draft_vocab", "draft_vocab")):
            if getattr(owner, key) <= 0:
                raise ConfigError(f"eagle3 {name} must be positive, got {getattr(owner, key)}")
        check_dims(self.target, "eagle3")
        if len(self.target_layer_ids) != NUM_FUSED_LAYERS:
            raise ConfigError(f"an EAGLE-3 drafter fuses {NUM_FUSED_LAYERS} target layers, got {self.target_layer_ids}")
        if not all(0 <= i < self.target.num_layers for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids {self.target_layer_ids} out of range for a target with "
                              f"{self.target.num_layers} layers")
        if self.loss_decay <= 0:
            raise ConfigError(f"eagle3 loss_decay must be positive, got {self.loss_decay}")

    @classmethod
    def from_target(cls, target_dir: str | Path, *, layer_ids: list[int], **overrides) -> "Eagle3Config":
        """The target's dimensions from its ``config.json``; ``overrides`` set any other field."""
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown EAGLE-3 config keys: {', '.join(sorted(unknown))}")
        return cls(target=draft_dims(target_dir), target_layer_ids=list(layer_ids),
                   **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class Eagle3TrainConfig(TrainSection, Eagle3Section):
    """The ``eagle3`` config section as the trainer takes it: ``total_steps`` resolved to a positive count."""

    SECTION = "eagle3"
    MODEL_KEYS = Eagle3ModelKeys
    MODEL_CONFIG = Eagle3Config

