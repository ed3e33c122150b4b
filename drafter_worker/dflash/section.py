"""The ``dflash`` config section: how a DFlash drafter is shaped and trained.

Torch-free: every process of a run loads it through :mod:`drafter_worker.dflash.family`, the
dispatcher too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.run.config import TrainingRecipe, opt


@dataclass
class DFlashModelKeys:
    """The dflash section's keys that shape the draft model: declared once, here, for the section
    and for the model's config (:class:`drafter_worker.dflash.config.DFlashConfig` adds what it reads from
    the target)."""
    block_size: int = opt(16, "Tokens per draft block: the anchor plus block_size - 1 drafted positions.")
    num_draft_layers: int = opt(5, "Draft decoder layers.")
    num_anchors: int = opt(512, "Most anchors (blocks) sampled per training sequence, re-drawn every time.")
    gamma: float = opt(0.0, "Loss decay: block position k weighs exp(-(k-1)/gamma); 0 = 7 for block 16, 5 for 10, 4 for 8.")
    mask_token_id: int = opt(-1, "Token id of the masked block positions; -1 = the tokenizer's mask token, else a reserved special token absent from the data, else an error.")


@dataclass
class DFlashSection(DFlashModelKeys, TrainingRecipe):
    section = "dflash"
    attention: Literal["auto", "flex", "sdpa"] = opt("auto", "Attention kernel: auto (flex attention on GPU, SDPA elsewhere), flex or sdpa.")

    def check(self) -> None:
        self.require_positive("block_size", "num_draft_layers", "num_anchors")
        super().check()
