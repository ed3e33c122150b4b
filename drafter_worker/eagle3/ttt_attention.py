"""Attention of the training-time test without a mask over every key.

At TTT step ``k`` a query at position ``t`` sees the step-0 keys at positions ``<= t`` and, of
each later step's keys, only the one at ``t`` (:mod:`drafter_worker.eagle3.ttt`). Of the
``(k + 1) × S`` keys of a sequence it may see ``t + 1 + k``: a boolean mask over all of them
(``S × (k + 1) S`` per step, rebuilt every micro-batch) is mostly the chains of other positions.
Two ways, the same softmax:

* ``flex`` (GPUs): one flex attention call over the keys of every step so far, with a
  ``BlockMask`` whose only tiles off the causal part are the diagonals of the later steps; its
  kernel skips the empty ones. The block mask depends on the length and the step alone, so it is
  built once per ``(S, k)`` (compiled, one graph whatever the length) and reused by every
  micro-batch of that length.
* ``structured`` (the CPU, or without flex attention): the causal scores against the step-0 keys,
  and one score per later step (the query against that step's key at its own position, a dot
  product), softmaxed together over ``S + k`` columns.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from drafter_worker import flex_compile

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) [B, kv_heads, S, D] of every step so far
NUM_CACHED_MASKS = 64  # block masks kept, by (length, step, device): sorted batches repeat their lengths

_block_masks: OrderedDict[tuple[int, int, str], object] = OrderedDict()


def _build_block_mask(seq_len: int, num_keys: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # step 0's causal keys, then each later step's own position
        return (kv_idx <= q_idx) | (kv_idx % seq_len == q_idx)

    return create_block_mask(mask_mod, None, None, seq_len, num_keys, device=device)


def ttt_block_mask(seq_len: int, num_steps: int, device: torch.device, *, compiled: bool | None = None):
    """The ``BlockMask`` of step ``num_steps - 1`` for ``seq_len`` positions (cached)."""
    key = (seq_len, num_steps, str(device))
    mask = _block_masks.get(key)
    if mask is None:
        if compiled if compiled is not None else torch.device(device).type == "cuda":
            mask = flex_compile.call("eagle3_block_mask", _build_block_mask, seq_len, seq_len * num_steps, device)
        else:
            mask = _build_block_mask(seq_len, seq_len * num_steps, device)
        _block_masks[key] = mask
        if len(_block_masks) > NUM_CACHED_MASKS:
            _block_masks.popitem(last=False)
    else:
        _block_masks.move_to_end(key)
    return mask


def ttt_attention(q: torch.Tensor, cache: KVCache, *, kind: str, compiled: bool | None = None) -> torch.Tensor:
    """``q [B, Hq, S, D]`` of the step whose keys are the last of ``cache``; returns ``[B, Hq, S, D]``."""
    if kind == "flex":
        keys = torch.cat([k for k, _ in cache], dim=2).to(q.dtype)
        values = torch.cat([v for _, v in cache], dim=2).to(q.dtype)
        block_mask = ttt_block_mask(q.shape[2], len(cache), q.device, compiled=compiled)
        return flex_compile.flex_attention(q, keys, values, block_mask, compiled=compiled)
    if kind != "structured":
        raise ValueError(f"unknown TTT attention kind {kind!r}")
    return _structured(q, cache)


def _structured(q: torch.Tensor, cache: KVCache) -> torch.Tensor:
    seq_len, groups = q.shape[2], q.shape[1] // cache[0][0].shape[1]
    scale = q.shape[-1] ** -0.5

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(groups, dim=1).to(q.dtype)

    k0, v0 = heads(cache[0][0]), heads(cache[0][1])
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    causal = (q @ k0.transpose(-1, -2) * scale).masked_fill(future, float("-inf"))  # [B, H, S, S]
    own = [(q * heads(k)).sum(-1, keepdim=True) * scale for k, _ in cache[1:]]  # [B, H, S, 1] each
    probs = torch.cat([causal, *own], dim=-1).float().softmax(-1).to(q.dtype)
    out = probs[..., :seq_len] @ v0
    for j, (_, v) in enumerate(cache[1:]):
        out = out + probs[..., seq_len + j:seq_len + j + 1] * heads(v)
    return out
