"""Whether a target can run as a tensor-parallel group of ``target.tp_size`` ranks: checked from its
``config.json`` before any process starts.

A group loads the target through Hugging Face's own tensor-parallel loading, which shards every
module its architecture's ``base_model_tp_plan`` names. Rank 0 writes the captured layers into the
slot from its own copy of each decoder layer's output, so that output — the residual stream — must
be whole on every rank. Under a plain plan it is: column-wise projections feed row-wise ones whose
outputs are all-reduced (replicated) before the residual add. A style that leaves the residual
stream split across the ranks (sequence parallelism: each rank holds a slice of the positions)
would make rank 0's copy a fragment, so a plan holding one is
refused, naming the module and the style, as is a style this list does not know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.run.config import ConfigError

# Styles whose output, as the next module sees it, is whole on every rank, or which only shard the
# inside of an attention or MLP block whose row-wise projection gathers it back.
REPLICATING_STYLES = frozenset({
    "colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output", "rowwise_split_input",
    "unit_colwise", "unit_rowwise", "packed_colwise", "packed_rowwise", "replicated_with_grad_allreduce",
    "replicate", "all_reduce", "embedding_rowwise", "embedding_colwise", "moe_tp_experts", "local_params",
    "mla_kv_a_proj",
})
# Styles that leave the residual stream (what is captured) sharded across the ranks.
SHARDING_STYLES = {
    "sequence_parallel": "splits the residual stream along the sequence (each rank holds a slice of the positions)",
}


def load_model_config(model_dir: str | Path) -> Any:
    """The target's Hugging Face config, from its local ``config.json`` (never downloads)."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"target.model: cannot read {Path(model_dir) / 'config.json'}: {exc}") from None


def architecture_of(config: Any) -> str:
    return (getattr(config, "architectures", None) or [type(config).__name__])[0]


def tp_plan_of(config: Any) -> dict[str, str]:
    """The decoder's tensor-parallel plan the installed transformers declares for this config ({}: none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def check_tensor_parallel(model_dir: str | Path, tp_size: int, *, config: Any = None) -> dict[str, str]:
    """The plan a group of ``tp_size`` ranks loads ``model_dir`` with; ``ConfigError`` naming the
    architecture when it has no plan, a plan that leaves the captured states sharded, or heads that
    ``tp_size`` does not divide."""
    import transformers
    config = config if config is not None else load_model_config(model_dir)
    architecture = architecture_of(config)
    where = f"{Path(model_dir) / 'config.json'}"
    plan = tp_plan_of(config)
    if tp_size <= 1:
        return plan
    from transformers.utils import is_accelerate_available
    if not is_accelerate_available():  # from_pretrained refuses a tensor-parallel plan without it
        raise ConfigError(f"target.tp_size={tp_size}: Hugging Face's tensor-parallel loading needs the accelerate "
                          f"package, not installed here: pip install accelerate (or make install)")
    if not plan:
        raise ConfigError(f"target.tp_size={tp_size}: {architecture} ({where}) has no tensor-parallel plan in the "
                          f"installed transformers {transformers.__version__}; set target.tp_size: 1 (one GPU "
                          f"per target), or train against an architecture that has one")
    for module, style in plan.items():
        if style in SHARDING_STYLES:
            raise ConfigError(f"target.tp_size={tp_size}: {architecture}'s tensor-parallel plan gives {module!r} the "
                              f"style {style!r}, which {SHARDING_STYLES[style]}: rank 0 would capture a fragment of "
                              f"each layer's hidden states; set target.tp_size: 1")
        if style not in REPLICATING_STYLES:
            raise ConfigError(f"target.tp_size={tp_size}: {architecture}'s tensor-parallel plan gives {module!r} the "
                              f"style {style!r}, not known to leave the captured hidden states whole on rank 0; "
                              f"set target.tp_size: 1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for key, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count is not None and count % tp_size:
            divisors = [d for d in range(1, count + 1) if count % d == 0 and (kv_heads or count) % d == 0]
            raise ConfigError(f"target.tp_size={tp_size} does not divide {architecture}'s {count} {key} ({where}): "
                              f"each rank must hold whole heads; use a tp_size among {divisors}")
    return plan


def architectures_with_tp_plan() -> list[str]:
    """Causal-LM model types of the installed transformers whose config declares a tensor-parallel plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError, AttributeError):
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            found.append(model_type)
    return sorted(found)
