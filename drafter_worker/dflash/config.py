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
from dataclasses import dataclass, field
from pathlib import Path

from common.run.config import ConfigError, opt
from common.run.target_config import TargetDims
from drafter_worker.dflash.section import DFlashModelKeys, DFlashSection
from drafter_worker.layers import check_dims, draft_dims
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
    gamma, mask_token_id: declared once, in :class:`drafter_worker.dflash.section.DFlashModelKeys`), the
    target's dimensions the draft layers take (:class:`common.run.target_config.TargetDims`, read by
    :meth:`from_target` or from an export; ``num_layers`` 0 when an export does not say) and the
    captured layers."""
    target: TargetDims = field(kw_only=True)
    target_layer_ids: list[int] = opt([], "Target layers whose outputs are fused (layer i = the raw output of decoder layer i, before any final norm).")
    mask_token: str = opt("", "Text of the mask token (exported beside its id for engines that look the id up by it); empty = unknown.")

    def __post_init__(self) -> None:
        if self.gamma == 0.0:
            self.gamma = default_gamma(self.block_size)
        # A run resolves mask_token_id -1 from the tokenizer (drafter_worker.dflash.mask_token) before it
        # builds the model; here, for a model built directly (tests and benches on random tokens), -1 is
        # the embedding's last row.
        if self.mask_token_id == -1 and self.target.vocab_size > 0:
            self.mask_token_id = self.target.vocab_size - 1
        self.validate()

    def validate(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2 (the anchor plus one drafted token), got {self.block_size}")
        for key in ("num_draft_layers", "num_anchors"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"dflash {key} must be positive, got {getattr(self, key)}")
        check_dims(self.target, "dflash")
        if not math.isfinite(self.gamma) or self.gamma <= 0:
            raise ConfigError(f"dflash gamma must be a positive number, got {self.gamma}")
        if not self.target_layer_ids:
            raise ConfigError("dflash target_layer_ids is empty: name the captured target layers")
        num_layers = self.target.num_layers
        if num_layers and not all(0 <= i < num_layers for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids {self.target_layer_ids} out of range for a target with "
                              f"{num_layers} layers")
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is not a row of the target embedding "
                              f"(vocab_size {self.target.vocab_size})")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_dir: str | Path, *, layer_ids: list[int], **overrides) -> "DFlashConfig":
        """The target's dimensions from its ``config.json``; ``overrides`` set any other field."""
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown DFlash config keys: {', '.join(sorted(unknown))}")
        return cls(target=draft_dims(target_dir), target_layer_ids=list(layer_ids),
                   **{k: v for k, v in overrides.items() if v is not None})


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

