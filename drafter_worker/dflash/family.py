"""DFlash as a drafter family (:mod:`common.run.drafter_family`): registered when imported. Torch-free;
the backend, the export loader and the proposer are imported when used."""

from __future__ import annotations

from common.run.capture_contract import default_layer_ids
from common.run.drafter_family import DemoDefaults, DrafterFamily, lazy, register
from drafter_worker.dflash.section import DFlashSection

OBJECTIVE = "dflash"
ARCHITECTURE = "DFlashDraftModel"  # an export's config.json architectures

FAMILY = register(DrafterFamily(
    objective=OBJECTIVE, title="DFlash", section=DFlashSection,
    default_layer_ids=default_layer_ids,  # K evenly spaced layers (target.num_capture_layers)
    backend=lazy("drafter_worker.dflash_backend:DFlashBackend"),
    load_proposer=lazy("drafter_worker.dflash.eval:load_proposer"),
    proposer=lazy("drafter_worker.dflash.eval:DFlashProposer"),  # of a live draft model (hsd eval, the demo)
    reads_export=lambda doc: ARCHITECTURE in doc.get("architectures", []),
    demo=DemoDefaults(config_name="demo-real.yaml", run_name="run", shape=lambda block_size: f"block {block_size}"),
    check_overrides=("target.capture_layers=[1,2]", "dflash.block_size=4", "dflash.gamma=2.0",
                     "dflash.num_draft_layers=1", "dflash.num_anchors=8"),
))
