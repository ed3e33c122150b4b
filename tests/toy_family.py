"""A third drafter family, defined wholly here: its own config section, a tiny backend, an export and a
proposer, registered in :mod:`common.run.drafter_family` when this module is imported.

A run reaches it by ``drafter.objective=toy`` with ``HSD_DRAFTER_FAMILIES=toy_family`` in the
environment (and this directory on ``PYTHONPATH``): every process of the run imports it then.
The backend is the linear model of :mod:`drafter_worker.linear_backend` trained at the section's
learning rate; each checkpoint also holds a servable export, which the proposer drafts from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.run.config import Section, opt
from common.run.drafter_family import DrafterFamily, register

OBJECTIVE = "toy"
ARCHITECTURE = "ToyDrafter"
EXPORT_WEIGHTS = "toy.safetensors"


@dataclass
class ToySection(Section):
    section = "toy"
    lr: float = opt(0.05, "SGD learning rate of the toy drafter.")
    num_drafts: int = opt(2, "Tokens the toy proposer drafts a round.")

    def check(self) -> None:
        self.require_positive("lr", "num_drafts")


def toy_layer_ids(num_layers: int, num_capture_layers: int) -> list[int]:
    """The toy's default capture: the last layer a serving engine captures, alone."""
    return [num_layers - 2]


class ToyModel:
    """The exported weights; drafts ``num_drafts`` copies of the last token."""
    objective = OBJECTIVE

    def __init__(self, tensors: dict, num_drafts: int):
        self.tensors, self.num_drafts = tensors, num_drafts


class ToyProposer:
    def __init__(self, model: ToyModel):
        self.model = model
        self.block_size = model.num_drafts + 1
        self.target_layer_ids: list[int] = []

    def propose(self, seq_ids, ctx_hs):
        return seq_ids[-1:].repeat(self.model.num_drafts)


def _backend(model_id: str, **sections):
    from drafter_worker.linear_backend import LinearDrafter
    from safetensors.torch import save_file

    class ToyBackend(LinearDrafter):
        section = "toy"

        def __init__(self, model_id: str, *, training: ToySection, target, drafter, run, data, device=None,
                     schedule_jobs=None):
            super().__init__(model_id, drafter=drafter, target=target, seed=run.seed, lr=training.lr)
            self.num_drafts = training.num_drafts

        def snapshot_checkpoint(self):
            snapshot = super().snapshot_checkpoint()
            weights, num_drafts = self.state_dict(), self.num_drafts

            def write_servable(directory: Path) -> None:
                save_file(weights, str(directory / EXPORT_WEIGHTS))
                (directory / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE],
                                                                   "num_drafts": num_drafts}))
            return type(snapshot)(snapshot.model_id, snapshot.step, snapshot.trained, write_servable=write_servable,
                                  write_training=snapshot.write_training, keep_last=snapshot.keep_last)

    return ToyBackend(model_id, **sections)


def _load_proposer(drafter_dir, target_dir, *, device="cpu") -> ToyProposer:
    from safetensors.torch import load_file
    doc = json.loads((Path(drafter_dir) / "config.json").read_text())
    return ToyProposer(ToyModel(load_file(str(Path(drafter_dir) / EXPORT_WEIGHTS), device=device),
                                doc["num_drafts"]))


FAMILY = register(DrafterFamily(
    objective=OBJECTIVE, title="toy", section=ToySection, default_layer_ids=toy_layer_ids,
    backend=_backend, load_proposer=_load_proposer, proposer=ToyProposer,
    reads_export=lambda doc: ARCHITECTURE in doc.get("architectures", []), needs_target_model=False,
))
