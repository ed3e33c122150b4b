"""Where a loaded Hugging Face causal LM keeps its decoder layers: the one place that knows.

The target worker captures their outputs (:mod:`target_worker.capture`) and ``hsd eval`` hooks the
same layers while it verifies a drafter (:mod:`drafter_worker.speculative_eval`): both must take a
layer's state from the same module, so both find it here.
"""

from __future__ import annotations

from torch import nn

LAYER_LIST_NAMES = ("layers", "h", "blocks")


def text_config(model: nn.Module):
    """The language model's config (multimodal models keep it in ``text_config``)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def find_decoder(model: nn.Module) -> tuple[nn.Module, str]:
    """(decoder module, attribute name of its layer list) of a Hugging Face causal LM.

    The decoder is the module whose forward runs embeddings, layers and final norm
    (``model.model`` for Llama, Qwen, Mistral, Gemma; the language model of a multimodal model).
    """
    num_layers = text_config(model).num_hidden_layers
    root = model.get_decoder() if hasattr(model, "get_decoder") else model
    for module in root.modules():
        for name in LAYER_LIST_NAMES:
            child = module._modules.get(name)
            if isinstance(child, nn.ModuleList) and len(child) == num_layers:
                return module, name
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}: "
                     f"expected a layer list named {' or '.join(LAYER_LIST_NAMES)}")
