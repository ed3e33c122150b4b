"""The frozen target's forward, stopped after the last captured layer, with only those layers kept.

A plain ``model(ids, output_hidden_states=True)`` keeps every layer's output alive until it
returns, runs the layers past the last one a drafter needs, and computes logits over the whole
vocabulary that nobody reads. :class:`LayerCapture` instead runs the model's own decoder (so every
Hugging Face decoder-only architecture keeps its embedding scaling, rotary embeddings, masks and
layer types) over a layer list cut after the last captured layer, without the LM head; forward
hooks on the captured layers copy each output straight into its column block of one preallocated
``[tokens, K × hidden]`` buffer, so no layer output outlives the layer that follows it.

The cut-down decoder is a shallow copy of the loaded one that shares every parameter: the full
model stays usable (the benchmark compares against it) at no extra memory.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from common.run.target_model import find_decoder, text_config

log = logging.getLogger("hsd.target")

_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")


def _from_pretrained_dtype_key() -> str:
    # transformers renamed from_pretrained's torch_dtype to dtype in 4.56; the old name warns since.
    import transformers
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


ATTN_KEY = "target.attn_implementation"
_FLASH = ("flash_attention_3", "flash_attention_2")  # fastest first


def supported_attn_implementations(model_class: type) -> list[str]:
    """The attention kernels a Hugging Face model class declares (its ``_supports_*`` flags), eager always."""
    kernels = ["eager"]
    if getattr(model_class, "_supports_sdpa", False):
        kernels.append("sdpa")
    if getattr(model_class, "_supports_flash_attn", False) or getattr(model_class, "_supports_flash_attn_2", False):
        kernels += list(_FLASH)
    if getattr(model_class, "_supports_flex_attn", False):
        kernels.append("flex_attention")
    return kernels


def causal_lm_class(model_dir: str | Path) -> type:
    """The ``AutoModelForCausalLM`` class of a local model directory, without loading its weights."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def resolve_attn_implementation(model_class: type, requested: str, device: torch.device) -> str:
    """``requested`` if the class supports it; for ``auto`` the fastest kernel it supports here: flash
    attention on a GPU where the package is installed, else SDPA, else eager. ``ConfigError`` otherwise."""
    from common.run.config import ConfigError
    supported = supported_attn_implementations(model_class)
    if requested != "auto":
        if requested not in supported:
            raise ConfigError(f"{ATTN_KEY}: {model_class.__name__} does not support {requested!r} in the installed "
                              f"transformers; it supports {', '.join(supported)} (or auto)")
        return requested
    if device.type == "cuda":
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available
        installed = {"flash_attention_3": is_flash_attn_3_available(), "flash_attention_2": is_flash_attn_2_available()}
        for kernel in _FLASH:
            if kernel in supported and installed[kernel]:
                return kernel
    return "sdpa" if "sdpa" in supported else "eager"


def load_target_model(model_dir: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                      device: torch.device, tp_size: int = 1) -> nn.Module:
    """A local causal LM, frozen and in eval mode, on ``device``; never downloads anything.

    ``attn_implementation`` is resolved by :func:`resolve_attn_implementation` (``auto`` allowed); the
    kernel used is logged and left in ``model.config._attn_implementation``. With ``tp_size`` > 1 the
    caller has joined a ``torch.distributed`` group of that many ranks: Hugging Face's tensor-parallel
    loading shards the model by its architecture's plan, each rank reading only its shard."""
    from transformers import AutoModelForCausalLM
    model_class = causal_lm_class(model_dir)
    kernel = resolve_attn_implementation(model_class, attn_implementation, device)
    log.info("target %s: attention %s%s", model_class.__name__, kernel,
             f" (auto, of {', '.join(supported_attn_implementations(model_class))})"
             if attn_implementation == "auto" else "")
    parallel: dict = {}
    if tp_size > 1:
        from transformers.distributed import DistributedConfig
        parallel["distributed_config"] = DistributedConfig(tp_size=tp_size)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=kernel,
                                                 local_files_only=True, **parallel,
                                                 **{_from_pretrained_dtype_key(): dtype})
    model.requires_grad_(False)
    model.eval()
    return model if tp_size > 1 else model.to(device)


def contract_shape_of(model: nn.Module) -> tuple[str, int, int]:
    """(architecture, decoder layers, hidden size) of a loaded model, to check against its config.json."""
    decoder, layers_name = find_decoder(model)
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return architectures[0], len(decoder._modules[layers_name]), text_config(model).hidden_size


def drop_unused_modules(model: nn.Module, *, last_layer: int) -> None:
    """Free the decoder layers past ``last_layer`` and the LM head (a :class:`LayerCapture` built
    before keeps working; the model's own forward no longer does)."""
    decoder, layers_name = find_decoder(model)
    decoder._modules[layers_name] = decoder._modules[layers_name][:last_layer + 1]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, child in list(model.named_children()):
        if output is not None and child is output:  # a head tied to the embedding keeps its weight alive
            model._modules[name] = None
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()


class LayerCapture:
    """Runs the decoder up to the last captured layer and returns ``[B, S, K × hidden]``; with
    ``final_norm`` it runs every layer and the final norm, whose output fills one more block
    (``[B, S, (K + 1) × hidden]``: what an EAGLE-3 drafter turns into the target's logits).

    The returned tensor is a view of one of ``num_buffers`` buffers, used in turn: it stays valid for
    the next ``num_buffers - 1`` calls (on a GPU, a slot copy drains one while the next forward fills
    the other). Inputs are right-padded ``input_ids``/``attention_mask`` of shape ``[B, S]`` with
    ``B × S <= max_tokens``.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, max_tokens: int, num_buffers: int = 1,
                 final_norm: bool = False):
        decoder, layers_name = find_decoder(model)
        layers = decoder._modules[layers_name]
        ids = list(layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= len(layers):
            raise ValueError(f"capture layers {ids} must be distinct, ascending and within 0..{len(layers) - 1}")
        self.layer_ids = ids
        self.hidden_size = text_config(model).hidden_size
        self.final_norm = final_norm
        self.row_width = (len(ids) + int(final_norm)) * self.hidden_size
        self.max_tokens = max_tokens
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Every captured layer is the raw output of its decoder layer (the residual stream, before
        # any final norm), the last layer's included: what vLLM and SGLang feed a drafter. The final
        # norm runs only for EAGLE-3's extra block, which reads it (hidden_states[N] of a plain
        # forward is that normed state, not layer N-1's output).
        self.last_layer = len(layers) - 1 if final_norm else ids[-1]  # the last layer the forward runs
        self._truncated = copy.copy(decoder)
        self._truncated._modules = dict(decoder._modules)
        self._truncated._modules[layers_name] = layers[:self.last_layer + 1]
        if not final_norm:
            for name in _FINAL_NORM_NAMES:
                if name in self._truncated._modules:
                    self._truncated._modules[name] = nn.Identity()
        self._hooks = [layers[layer].register_forward_hook(self._hook(k)) for k, layer in enumerate(ids)]
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self.next_buffer = 0  # index of the buffer the next call fills
        self._out: torch.Tensor | None = None  # set only during a call: the hooks are shared with the full model

    def _hook(self, k: int):
        columns = slice(k * self.hidden_size, (k + 1) * self.hidden_size)

        def hook(_module: nn.Module, _args: tuple, output) -> None:
            if self._out is not None:
                state = output[0] if isinstance(output, tuple) else output
                if state.shape[-1] != self.hidden_size or isinstance(state, DTensor):
                    # a tensor-parallel plan that leaves the residual stream split across the ranks
                    raise ValueError(f"decoder layer {self.layer_ids[k]} returned a {type(state).__name__} of width "
                                     f"{state.shape[-1]}, not the whole hidden state ({self.hidden_size}): its "
                                     f"tensor-parallel plan leaves the captured states sharded; use target.tp_size: 1")
                self._out[..., columns].copy_(state)
        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len = input_ids.shape
        if batch_size * seq_len > self.max_tokens:
            raise ValueError(f"a batch of {batch_size} × {seq_len} exceeds the capture buffer of {self.max_tokens} tokens")
        index = self.next_buffer
        if self._buffers[index] is None:  # allocated once, at the largest shape, and reused by every job
            self._buffers[index] = torch.empty(self.max_tokens * self.row_width, dtype=self.dtype, device=self.device)
        self.next_buffer = (index + 1) % len(self._buffers)
        out = self._buffers[index][:batch_size * seq_len * self.row_width].view(batch_size, seq_len, self.row_width)
        self._out = out
        try:
            result = self._truncated(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            self._out = None
        if self.final_norm:
            out[..., -self.hidden_size:].copy_(result.last_hidden_state)
        return out

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._buffers = [None] * len(self._buffers)
