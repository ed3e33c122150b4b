"""One compiled graph for each of flex attention and its block mask, whatever a job's shape.

Both drafters call flex attention on GPUs (DFlash's block-sparse mask, EAGLE-3's training-time
test); eager flex attention materialises every score and an eager ``create_block_mask`` the dense
mask, so both are compiled. Left to itself, dynamo compiles each of them three times on every
drafter start: the first shape as it is (static), a symbolic graph once a dimension is seen to
change, and a third for a batch of one (sizes 0 and 1 are specialised). Jobs of sorted lengths
give nearly every job its own ``[sequences, length]``, so every start pays all three.

Here every dimension that follows the job is marked dynamic before the first call (the batch and
the sequence axes of the inputs, and of tensors a mask function closes over), and tracing runs
with ``backed_size_oblivious``, under which a size of one is no reason to specialise: one graph
each, compiled at the first micro-batch. (``create_block_mask(_compile=True)`` is deprecated and
wrapped a fresh ``torch.compile`` on every call.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx.experimental._config as fx_config

BACKEND = "inductor"  # what torch.compile lowers to (tests count graphs with a backend the CPU can run)
MAX_COMPILED_SHAPES = 64  # recompiles allowed before dynamo would give up on new ones (dtypes, flags)

_compiled: dict[str, Callable] = {}


def mark_dynamic(tensor: torch.Tensor, *dims: int) -> None:
    """The dimensions of ``tensor`` that follow the job: traced symbolically from the first call."""
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def compiled(name: str, fn: Callable) -> Callable:
    """``fn`` compiled once per process (by ``name``), with dynamic shapes."""
    if name not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_COMPILED_SHAPES)
        _compiled[name] = torch.compile(fn, dynamic=True, backend=BACKEND)
    return _compiled[name]


def call(name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``compiled(name, fn)(*args, **kwargs)``, traced (when it is) without specialising sizes of one."""
    with fx_config.patch(backed_size_oblivious=True):
        return compiled(name, fn)(*args, **kwargs)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, *,
                   compiled: bool | None = None) -> torch.Tensor:
    """Flex attention (grouped-query heads allowed); compiled on GPU (``compiled`` defaults to it: the
    eager version materialises the scores), one graph whatever the batch and the lengths."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if not (q.device.type == "cuda" if compiled is None else compiled):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    for tensor in (q, k, v):
        mark_dynamic(tensor, 0, 2)
    return call("flex_attention", flex, q, k, v, block_mask=block_mask, enable_gqa=True)
