"""The block-sparse attention pattern of DFlash training, written once as a predicate.

Queries are the draft blocks of one sequence laid end to end (block j = query rows
``j*B .. j*B+B-1``). Keys are the sequence's ``S`` context positions followed by the same blocks.
Block j, anchored at position ``a_j``, may see:

* context position ``p`` iff ``p < a_j`` — strictly before the anchor, because at inference the
  anchor is the target's bonus token, whose own hidden state does not exist yet;
* every token of its own block (bidirectional inside the block);
* nothing of any other block.

:func:`block_mask_predicate` is that rule as a ``mask_mod`` (flex attention evaluates it lazily on
GPU) and :func:`dense_block_mask` evaluates the same predicate on index grids (the dense reference
of :mod:`drafter_worker.dflash.attention`). Every query row sees at least its own block, so no row is
fully masked (no NaN), and padded anchors (a block that is not real) only waste compute.
"""

from __future__ import annotations

from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block_mask_predicate(anchors_BN: torch.Tensor, *, ctx_len: int, block_size: int) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` for anchors ``[batch, num_blocks]``."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchors_BN[b, q_block]
        is_ctx = kv_idx < ctx_len
        sees_ctx = is_ctx & (kv_idx < anchor)
        kv_block = (kv_idx - ctx_len) // block_size
        sees_block = ~is_ctx & (kv_block == q_block)
        return sees_ctx | sees_block

    return mask_mod


def dense_block_mask(anchors_BN: torch.Tensor, *, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask ``[batch, 1, N*B, ctx_len + N*B]`` (True = may attend), for SDPA."""
    batch, num_blocks = anchors_BN.shape
    num_q = num_blocks * block_size
    device = anchors_BN.device
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    q_idx = torch.arange(num_q, device=device).view(1, num_q, 1)
    kv_idx = torch.arange(ctx_len + num_q, device=device).view(1, 1, ctx_len + num_q)
    mask_mod = block_mask_predicate(anchors_BN, ctx_len=ctx_len, block_size=block_size)
    return mask_mod(b, None, q_idx, kv_idx).unsqueeze(1)


def block_positions(anchors_BN: torch.Tensor, block_size: int) -> torch.Tensor:
    """RoPE positions of the block tokens ``[batch, N*B]``: anchor a's block sits at a .. a+B-1."""
    offsets = torch.arange(block_size, device=anchors_BN.device)
    return (anchors_BN.unsqueeze(-1) + offsets).flatten(1)


def flex_block_mask(anchors_BN: torch.Tensor, *, ctx_len: int, block_size: int, compiled: bool | None = None):
    """The same pattern as a flex-attention ``BlockMask`` (built on the anchors' device).

    The anchors differ in every micro-batch, so the mask is built for each; on GPU (``compiled``
    defaults to it) its building is compiled, one graph for every shape
    (:mod:`drafter_worker.flex_compile`), so that it neither materialises the dense mask nor runs eagerly."""
    from drafter_worker import flex_compile
    if compiled is None:
        compiled = anchors_BN.device.type == "cuda"
    if not compiled:
        return _build_block_mask(anchors_BN, ctx_len, block_size)
    flex_compile.mark_dynamic(anchors_BN, 0, 1)
    return flex_compile.call("dflash_block_mask", _build_block_mask, anchors_BN, ctx_len, block_size)


def _build_block_mask(anchors_BN: torch.Tensor, ctx_len: int, block_size: int):
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_blocks = anchors_BN.shape
    num_q = num_blocks * block_size
    mask_mod = block_mask_predicate(anchors_BN, ctx_len=ctx_len, block_size=block_size)
    return create_block_mask(mask_mod, batch, None, num_q, ctx_len + num_q, device=anchors_BN.device)
