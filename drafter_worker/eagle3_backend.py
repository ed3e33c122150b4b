"""The EAGLE-3 drafter behind the worker loop (``drafter.objective: eagle3``).

Everything but the model is every drafter's (:class:`drafter_worker.drafter_backend.TrainerBackend`):
checkpoints and the witness, the data-parallel group's sums (:meth:`sync_gradients`),
commit-then-apply, the step metrics. What differs: the capture contract must carry the target's
final-norm state (the drafter computes the target's distribution from it), the draft vocabulary is
counted from the prepared dataset at start-up (every rank and every resume counts the same), and
each checkpoint holds an EAGLE-3 export (:mod:`drafter_worker.eagle3.export`) beside the training
state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from common.run.config import ConfigError
from common.run.prepared import PreparedDataset
from common.run.target_config import TargetDims
from drafter_worker.drafter_backend import TrainerBackend
from drafter_worker.eagle3.config import Eagle3TrainConfig
from drafter_worker.eagle3.export import export_config
from drafter_worker.eagle3.family import OBJECTIVE
from drafter_worker.eagle3.trainer import Eagle3Trainer
from drafter_worker.eagle3.vocab import count_response_tokens, draft_vocab_from_counts

log = logging.getLogger("hsd.eagle3")


def draft_vocab_of_dataset(data_path: str, vocab_size: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of the prepared dataset's response tokens; logs the share of them it covers."""
    if not data_path:
        raise ConfigError("data.path: an EAGLE-3 drafter counts its draft vocabulary in the prepared dataset; "
                          "set data.path")
    dataset = PreparedDataset(data_path)
    counts = count_response_tokens(dataset.tokens, dataset.loss_mask, vocab_size)
    size = min(draft_vocab, vocab_size)
    d2t, t2d = draft_vocab_from_counts(counts, size)
    total = int(counts.sum())
    covered = int(counts[t2d.numpy()].sum())
    log.info("draft vocabulary: %d of %d target tokens, %.4f of the %d response tokens", size, vocab_size,
             covered / total if total else 1.0, total)
    return d2t, t2d


class Eagle3Backend(TrainerBackend):
    """A :class:`common.worker.backends.DrafterBackend` training an EAGLE-3 drafter with :class:`Eagle3Trainer`."""

    section = "eagle3"
    train_config_class = Eagle3TrainConfig
    trainer_class = Eagle3Trainer
    export_config = staticmethod(export_config)
    target_use = "the EAGLE-3 drafter reads the target's config.json and uses its embedding and LM head"
    log = log

    def _resolve_section(self, section):
        if self.drafter.objective != OBJECTIVE:
            raise ConfigError(f"drafter.objective is {self.drafter.objective!r}: an EAGLE-3 drafter needs {OBJECTIVE} "
                              f"(the capture contract then carries the target's final-norm state)")
        vocab_size = TargetDims.read(self.target_dir).vocab_size  # multimodal: the language model's
        self.d2t, self.t2d = draft_vocab_of_dataset(self.data.path, vocab_size, section.draft_vocab)
        return section

    def _trainer_extras(self) -> dict[str, Any]:
        return {"d2t": self.d2t, "t2d": self.t2d}
