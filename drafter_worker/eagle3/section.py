"""The ``eagle3`` config section: how an EAGLE-3 drafter is shaped and trained.

Torch-free: every process of a run loads it through :mod:`drafter_worker.eagle3.family`, the
dispatcher too."""

from __future__ import annotations

from dataclasses import dataclass

from common.run.config import TrainingRecipe, opt


@dataclass
class Eagle3ModelKeys:
    """The eagle3 section's keys that shape the draft model, for the section and for
    :class:`drafter_worker.eagle3.config.Eagle3Config` (which adds the target's dimensions)."""
    ttt_steps: int = opt(7, "Training-time test: steps unrolled on the drafter's own hidden states (and tokens drafted at evaluation).")
    draft_vocab: int = opt(32000, "Draft vocabulary: the most frequent target tokens of the training responses (capped at the target's vocabulary).")
    loss_decay: float = opt(0.8, "Step k of the training-time test weighs loss_decay ** k.")


@dataclass
class Eagle3Section(Eagle3ModelKeys, TrainingRecipe):
    section = "eagle3"
    lr: float = opt(1e-4, "Peak AdamW learning rate.")
    warmup_ratio: float = opt(0.015, "Share of the total steps spent warming the learning rate up linearly.")
    grad_clip: float = opt(0.5, "Clip the global gradient norm to this; 0 = no clipping.")

    def check(self) -> None:
        self.require_positive("ttt_steps", "draft_vocab", "loss_decay", "loss_chunk_size")
        super().check()
