"""DFlash as a drafter family (:mod:`common.run.drafter_family`): registered when imported. Torch-free;
the backend, the export loader and the proposer are imported when used."""

from __future__ import annotations

from common.run.drafter_family import DemoDefaults, DrafterFamily, lazy, register
from drafter_worker.dflash.section import DFlashSection

OBJECTIVE = "dflash"
ARCHITECTURE = "DFlashDraftModel"  # an export's config.json architectures


def default_layer_ids(num_layers: int, num_capture_layers: int = 5) -> list[int]:
    """The DFlash choice: K layers evenly spaced from layer 1 to layer N−3; one layer → the middle one
    (at most N−2: the last layer's output is one no serving engine captures).

    Python's ``round`` (half to even) places the in-between layers, as the published DFlash drafters
    record them, so a drafter trained here lists the same ids as theirs for the same target.
    """
    if num_capture_layers <= 0:
        raise ValueError(f"the number of capture layers must be positive, got {num_capture_layers}")
    if num_capture_layers == 1:
        return [max(0, min(num_layers // 2, num_layers - 2))]
    first, last = 1, num_layers - 3
    if last - first + 1 < num_capture_layers:
        raise ValueError(f"{num_capture_layers} capture layers do not fit between layer {first} and layer "
                         f"{last} of a {num_layers}-layer target; lower target.num_capture_layers or list "
                         f"target.capture_layers")
    span = last - first
    return [round(first + k * span / (num_capture_layers - 1)) for k in range(num_capture_layers)]


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
