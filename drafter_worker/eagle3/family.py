"""EAGLE-3 as a drafter family (:mod:`common.run.drafter_family`): registered when imported. Torch-free;
the backend, the export loader and the proposer are imported when used."""

from __future__ import annotations

from common.run.drafter_family import DemoDefaults, DrafterFamily, lazy, register
from drafter_worker.eagle3.section import Eagle3Section

OBJECTIVE = "eagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # an export's config.json architectures
NUM_FUSED_LAYERS = 3  # serving engines build fc as 3 x hidden -> hidden


def eagle3_layer_ids(num_layers: int, num_capture_layers: int = NUM_FUSED_LAYERS) -> list[int]:
    """The EAGLE-3 choice: a low, a middle and a high layer, the outputs of layers 1, N/2 − 1 and N − 4
    (Qwen3-8B, 36 layers: 1, 17, 32, i.e. ``hidden_states`` indices 2, 18, 33); ``num_capture_layers``
    (target.num_capture_layers) does not change it."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if ids != sorted(set(ids)):
        raise ValueError(f"the EAGLE-3 default layers 1, N/2-1, N-4 of a {num_layers}-layer target are {ids}, not "
                         f"three distinct ascending layers; list three in target.capture_layers")
    return ids


FAMILY = register(DrafterFamily(
    objective=OBJECTIVE, title="EAGLE-3", section=Eagle3Section, default_layer_ids=eagle3_layer_ids,
    backend=lazy("drafter_worker.eagle3_backend:Eagle3Backend"),
    load_proposer=lazy("drafter_worker.eagle3.eval:load_proposer"),
    proposer=lazy("drafter_worker.eagle3.eval:Eagle3Proposer"),  # of a live draft model (hsd eval, the demo)
    reads_export=lambda doc: ARCHITECTURE in doc.get("architectures", []),
    # The drafter turns the target's final-norm state into the target's logits with the frozen LM head.
    final_norm=True, num_fused_layers=NUM_FUSED_LAYERS,
    demo=DemoDefaults(config_name="demo-eagle3.yaml", run_name="run-eagle3",
                      shape=lambda block_size: f"{block_size - 1} chained drafts"),
    check_overrides=("target.capture_layers=[0,1,2]", "eagle3.ttt_steps=3", "eagle3.draft_vocab=256"),
))
