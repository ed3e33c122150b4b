"""Attention of the draft blocks under the DFlash mask, computed without the keys the mask forbids.

A query of block j (anchored at ``a_j``) sees the context keys before ``a_j`` and the keys of its
own block, nothing else (:mod:`drafter_worker.dflash.mask`). Of the ``S + N*B`` keys of a sequence
(context, then the blocks) it may see at most ``a_j + B``: at 4 x 512 tokens with 64 anchors of 16,
the keys of the other blocks alone are two thirds of them. :class:`DraftAttention` holds what one
forward pass needs to compute the pattern, built once from the anchors and shared by every layer,
in one of three ways:

* ``split`` (the CPU): the context part (each block query against the ``S`` context keys, those at
  or after its anchor masked) and the in-block part (each block against its own ``B`` keys, the
  blocks a batch of small problems) are two fused SDPA kernel calls, each also returning the
  log-sum-exp of its scores; combined by it, they are the softmax over both parts. The keys of
  other blocks are never touched.
* ``flex`` (GPUs): one flex attention call over ``[context, blocks]`` with a ``BlockMask``; its
  kernel skips the tiles the mask leaves empty. Compiled, one dynamic graph for every shape (a
  job's batch shape follows its sorted lengths), as is the building of the block mask.
* ``dense``: one SDPA call over every key with the boolean mask. The reference the others are
  tested against, and the path of a device that has neither kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter_worker.dflash.mask import dense_block_mask, flex_block_mask
from drafter_worker.flex_compile import flex_attention

# The CPU's fused SDPA kernel, called directly: unlike F.scaled_dot_product_attention it also returns
# the log-sum-exp of the scores, and its backward takes the log-sum-exp it should use.
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_cpu_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def attention_kind(requested: str, device: torch.device) -> str:
    """``flex`` and ``dense`` as asked; ``sdpa`` is ``split`` where the CPU kernel is, else ``dense``."""
    if requested in ("flex", "dense"):
        return requested
    if requested != "sdpa":
        raise ValueError(f"unknown attention {requested!r} (flex, sdpa or dense)")
    return "split" if device.type == "cpu" and _flash_cpu is not None else "dense"


def _per_block(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, N*blk, ...]`` -> ``[B*N, H, blk, ...]``: each block its own attention problem."""
    batch, heads, num_q = x.shape[:3]
    x = x.view(batch, heads, num_q // block_size, block_size, *x.shape[3:]).transpose(1, 2)
    return x.reshape(-1, heads, block_size, *x.shape[4:])


def _from_blocks(x: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`_per_block`."""
    num_blocks, heads, block_size = x.shape[0] // batch, x.shape[1], x.shape[2]
    x = x.view(batch, num_blocks, heads, block_size, *x.shape[3:]).transpose(1, 2)
    return x.reshape(batch, heads, num_blocks * block_size, *x.shape[4:])


class _SplitAttention(torch.autograd.Function):
    """Softmax attention over ``[context keys (masked by ctx_bias), own block's keys]``, from two kernel
    calls combined by their log-sum-exp. Every head count is the query's (callers repeat k/v heads)."""

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, ctx_bias, has_ctx, block_size: int):
        batch = q.shape[0]
        out_ctx, lse_ctx = _flash_cpu(q, k_ctx, v_ctx, attn_mask=ctx_bias)
        # A row whose context keys are all masked (anchor 0, padded anchors) comes back with a
        # log-sum-exp of 0, as if it had one key of score 0: it has none.
        lse_ctx = lse_ctx.masked_fill(~has_ctx, float("-inf"))
        q_b, k_b, v_b = (_per_block(t, block_size) for t in (q, k_blk, v_blk))
        out_blk, lse_blk = _flash_cpu(q_b, k_b, v_b)
        out_blk, lse_blk = _from_blocks(out_blk, batch), _from_blocks(lse_blk, batch)
        lse = torch.logaddexp(lse_ctx, lse_blk)  # every row sees its own block: finite
        out = ((lse_ctx - lse).exp().unsqueeze(-1) * out_ctx
               + (lse_blk - lse).exp().unsqueeze(-1) * out_blk).to(q.dtype)
        ctx.save_for_backward(q, k_ctx, v_ctx, q_b, k_b, v_b, ctx_bias, out, lse)
        ctx.block_size = block_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_ctx, v_ctx, q_b, k_b, v_b, ctx_bias, out, lse = ctx.saved_tensors
        block, batch = ctx.block_size, q.shape[0]
        grad_out = grad_out.contiguous()
        # Each part's backward is given the output and log-sum-exp of the whole softmax: its
        # probabilities are then its share of the whole and the row sums of grad_out * out are the
        # whole's, which makes it exactly the gradient of the combined attention with respect to that
        # part's keys and values, and that part's term of the queries' gradient.
        dq, dk_ctx, dv_ctx = _flash_cpu_backward(grad_out, q, k_ctx, v_ctx, out, lse, 0.0, False, attn_mask=ctx_bias)
        dq_b, dk_b, dv_b = _flash_cpu_backward(_per_block(grad_out, block), q_b, k_b, v_b,
                                               _per_block(out, block), _per_block(lse, block), 0.0, False)
        dq = dq + _from_blocks(dq_b, batch)
        return dq, dk_ctx, dv_ctx, _from_blocks(dk_b, batch), _from_blocks(dv_b, batch), None, None, None


class DraftAttention:
    """The block-sparse attention of one forward pass (anchors ``[batch, N]``), for every layer."""

    def __init__(self, anchors_BN: torch.Tensor, *, ctx_len: int, block_size: int, kind: str):
        self.kind, self.ctx_len, self.block_size = kind, ctx_len, block_size
        if kind == "split":
            anchor_q = anchors_BN.repeat_interleave(block_size, dim=1)  # [batch, N*B], a scalar repeat count
            self._sees_ctx = torch.arange(ctx_len, device=anchors_BN.device) < anchor_q.view(*anchor_q.shape, 1)
            self._has_ctx = (anchor_q > 0).unsqueeze(1)  # [batch, 1, N*B]
            self._bias: dict[torch.dtype, torch.Tensor] = {}
        elif kind == "flex":
            self._block_mask = flex_block_mask(anchors_BN, ctx_len=ctx_len, block_size=block_size)
        elif kind == "dense":
            self._mask = dense_block_mask(anchors_BN, ctx_len=ctx_len, block_size=block_size)
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def _ctx_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[batch, 1, N*B, S]`` of the context part (the CPU kernel takes the query's dtype)."""
        if dtype not in self._bias:
            zero = torch.zeros((), dtype=dtype, device=self._sees_ctx.device)
            self._bias[dtype] = torch.where(self._sees_ctx, zero, float("-inf")).unsqueeze(1)
        return self._bias[dtype]

    def __call__(self, q, k_ctx, v_ctx, k_blk, v_blk) -> torch.Tensor:
        """``q [B, Hq, N*blk, D]``, ``k/v_ctx [B, Hkv, S, D]``, ``k/v_blk [B, Hkv, N*blk, D]``; returns
        ``[B, Hq, N*blk, D]``."""
        if self.kind == "flex":
            return flex_attention(q, torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2),
                                  self._block_mask)
        groups = q.shape[1] // k_ctx.shape[1]
        k_ctx, v_ctx, k_blk, v_blk = (t.repeat_interleave(groups, dim=1) for t in (k_ctx, v_ctx, k_blk, v_blk))
        if self.kind == "split":
            return _SplitAttention.apply(q, k_ctx, v_ctx, k_blk, v_blk, self._ctx_bias(q.dtype), self._has_ctx,
                                         self.block_size)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask)
