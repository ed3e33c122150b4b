"""The DFlash drafter behind the worker loop: trains on the hidden states a real target captured.

Checkpoints, the witness, the group's sums and the step's bookkeeping are every drafter's
(:class:`drafter_worker.drafter_backend.TrainerBackend`). What is DFlash's own: the mask token,
chosen once at start (the tokenizer's mask token or a reserved one, never a token of the data:
:mod:`drafter_worker.dflash.mask_token`) and exported beside its id, and the anchors of a job's
blocks, drawn from the run seed and the job id alone.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from common.mix import splitmix64
from common.run.target_config import TargetDims
from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.export import export_config
from drafter_worker.dflash.mask_token import mask_token_text, resolve_mask_token_id
from drafter_worker.dflash.trainer import DFlashTrainer
from drafter_worker.drafter_backend import TrainerBackend

log = logging.getLogger("hsd.dflash")


def anchor_seed(run_seed: int, job_id: int) -> int:
    """The seed of a job's anchor draw, a hash of the run seed and the job id."""
    return splitmix64(splitmix64(run_seed) ^ job_id) >> 1  # a generator seed must fit in int64


class DFlashBackend(TrainerBackend):
    """A :class:`common.worker.backends.DrafterBackend` training a DFlash drafter with :class:`DFlashTrainer`."""

    section = "dflash"
    train_config_class = DFlashTrainConfig
    trainer_class = DFlashTrainer
    export_config = staticmethod(export_config)
    target_use = "the DFlash drafter reads the target's config.json and shares its embedding and LM head"
    log = log

    def __init__(self, model_id: str, **kwargs: Any):
        self.mask_token = ""  # its text in the target's tokenizer, exported beside the id
        super().__init__(model_id, **kwargs)

    def _resolve_section(self, section):
        # Chosen once, at start: the tokenizer's mask token or a reserved one, never a token of the data.
        section = dataclasses.replace(section, mask_token_id=resolve_mask_token_id(
            section, target=self.target, data=self.data, run_dir=self.run_dir,
            vocab_size=TargetDims.read(self.target_dir).vocab_size))
        self.mask_token = mask_token_text(self.target_dir, section.mask_token_id)
        return section

    def _seed_job(self, job_id: int) -> None:
        # A job's anchors depend on the run seed and the job id alone: every rank of a group draws
        # its own, a job trained again after a rollback sees the same blocks, and a resume needs no RNG.
        self.trainer.anchor_generator.manual_seed(anchor_seed(self.seed, job_id))

    def _servable_config(self, dtype: str) -> dict:
        doc = super()._servable_config(dtype)
        if self.mask_token:
            doc["dflash_config"]["mask_token"] = self.mask_token
        return doc
