"""DFlash as a drafter family (:mod:`common.run.drafter_family`): registered when imported. Torch-free;
the backend, the export loader and the proposer are imported when used."""

from __future__ import annotations

from common.run.capture_contract import default_layer_ids
from common.run.drafter_family import DemoDefaults, DrafterFamily, register
from drafter_worker.dflash.section import DFlashSection

OBJECTIVE = "dflash"
ARCHITECTURE = "DFlashDraftModel"  # an export's config.json architectures


def _backend_class() -> type:
    from drafter_worker.dflash_backend import DFlashBackend
    return DFlashBackend


def _load_proposer(drafter_dir, target_dir, *, device="cpu"):
    from drafter_worker.dflash.eval import load_proposer
    return load_proposer(drafter_dir, target_dir, device=device)


def _proposer(model):
    from drafter_worker.dflash.eval import DFlashProposer
    return DFlashProposer(model)


FAMILY = register(DrafterFamily(
    objective=OBJECTIVE, title="DFlash", section=DFlashSection,
    default_layer_ids=default_layer_ids,  # K evenly spaced layers (target.num_capture_layers)
    backend_class=_backend_class, load_proposer=_load_proposer, proposer=_proposer,
    reads_export=lambda doc: ARCHITECTURE in doc.get("architectures", []),
    demo=DemoDefaults(config_name="demo-real.yaml", run_name="run", shape=lambda block_size: f"block {block_size}"),
    check_overrides=("target.capture_layers=[1,2]", "dflash.block_size=4", "dflash.gamma=2.0",
                     "dflash.num_draft_layers=1", "dflash.num_anchors=8"),
))
