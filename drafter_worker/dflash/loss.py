"""Position-weighted cross-entropy of the draft blocks.

Block position k (1..B-1) weighs ``w_k = exp(-(k-1)/gamma)``: an early mistake ends the accepted
prefix, so the first positions matter most. The loss of a set of blocks is the weighted sum of the
CE over its supervised positions divided by the sum of their weights. :func:`weighted_ce` returns
the two parts separately so that a training step can add them up over micro-batches (and ranks)
before dividing: every supervised position of the step then counts the same, whatever micro-batch
it came in.

Every figure stays a tensor on the device (the weight total, the top-1 hits and counts too): a
training step reads them back once, at its end. Unsupervised positions (``IGNORE``) may be passed:
they weigh 0, which keeps the shapes fixed where selecting the supervised ones would have to read
their number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter_worker.dflash.anchors import IGNORE


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``[block_size]`` weights; position 0 (the anchor) weighs 0."""
    k = torch.arange(block_size, dtype=torch.float64)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights.float()


@dataclass
class BlockLoss:
    weighted_sum: torch.Tensor  # scalar, differentiable: sum of w_k * CE over supervised positions
    weight_total: torch.Tensor  # float64 scalar: sum of w_k over the same positions
    correct_K: torch.Tensor     # [block_size] top-1 hits per block position (position 0 unused)
    count_K: torch.Tensor       # [block_size] supervised positions per block position

    @property
    def loss(self) -> float:
        """The weighted mean CE (a host read: for tests and reports, not the training loop)."""
        weight = float(self.weight_total)
        return float(self.weighted_sum.detach()) / weight if weight else math.nan


def _supervised_weights(labels_P: torch.Tensor, block_pos_P: torch.Tensor, weights_K: torch.Tensor) -> torch.Tensor:
    weights_P = weights_K.to(labels_P.device)[block_pos_P]
    return torch.where(labels_P != IGNORE, weights_P, 0.0)


def _counts(hits_P: torch.Tensor, labels_P: torch.Tensor, block_pos_P: torch.Tensor, weights_P: torch.Tensor,
            block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weight total, top-1 hits and supervised counts per block position (fixed-size sums, no read)."""
    zeros = torch.zeros(block_size, dtype=torch.long, device=labels_P.device)
    supervised_P = (labels_P != IGNORE).long()
    correct_K = zeros.index_add(0, block_pos_P, hits_P.long() * supervised_P)
    count_K = zeros.index_add(0, block_pos_P, supervised_P)
    return weights_P.double().sum(), correct_K, count_K


def weighted_ce(logits_PV: torch.Tensor, labels_P: torch.Tensor, block_pos_P: torch.Tensor,
                weights_K: torch.Tensor) -> BlockLoss:
    """Weighted CE of ``P`` positions from their logits (``IGNORE`` labels weigh nothing).

    ``block_pos_P`` is each position's index k inside its block, ``weights_K`` from :func:`position_weights`.
    """
    weights_P = _supervised_weights(labels_P, block_pos_P, weights_K)
    ce_P = F.cross_entropy(logits_PV.float(), labels_P, reduction="none", ignore_index=IGNORE)
    hits_P = logits_PV.detach().argmax(-1) == labels_P
    weight_total, correct_K, count_K = _counts(hits_P, labels_P, block_pos_P, weights_P, weights_K.numel())
    return BlockLoss(weighted_sum=(ce_P * weights_P).sum(), weight_total=weight_total, correct_K=correct_K,
                     count_K=count_K)


def _chunk_logits(hidden_CH: torch.Tensor, head_VH: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden_CH.to(head_VH.dtype), head_VH).float()


class _ChunkedHeadCE(torch.autograd.Function):
    """Sum of ``w * CE(head(hidden), label)`` over positions, ``chunk_size`` at a time, and the top-1
    hits. The backward recomputes each chunk's logits (they are not kept) and forms their gradient
    ``w * (softmax - onehot)`` directly; the hits are computed once, in the forward. The head is the
    target's frozen LM head: it gets no gradient."""

    @staticmethod
    def forward(ctx, hidden_PH, head_VH, labels_P, weights_P, chunk_size: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden_PH.device)
        hits_P = torch.empty(labels_P.shape, dtype=torch.bool, device=hidden_PH.device)
        for start in range(0, labels_P.numel(), chunk_size):
            part = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden_PH[part], head_VH)
            ce = F.cross_entropy(logits, labels_P[part], reduction="none", ignore_index=IGNORE)
            total = total + (ce * weights_P[part]).sum()
            hits_P[part] = logits.argmax(-1) == labels_P[part]
        ctx.save_for_backward(hidden_PH, head_VH, labels_P, weights_P)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(hits_P)
        return total, hits_P

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        hidden_PH, head_VH, labels_P, weights_P = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden_PH)
        safe_labels = labels_P.clamp(min=0)  # IGNORE rows weigh 0: whatever column they subtract from
        for start in range(0, labels_P.numel(), ctx.chunk_size):
            part = slice(start, start + ctx.chunk_size)
            grad_logits = _chunk_logits(hidden_PH[part], head_VH).softmax(-1)
            label_C1 = safe_labels[part].unsqueeze(-1)
            grad_logits.scatter_add_(1, label_C1, torch.full(label_C1.shape, -1.0, device=grad_logits.device))
            grad_logits *= (weights_P[part] * grad_total).unsqueeze(-1)
            grad_hidden[part] = (grad_logits.to(head_VH.dtype) @ head_VH).to(hidden_PH.dtype)
        return grad_hidden, None, None, None, None


def weighted_ce_chunked(hidden_PH: torch.Tensor, head_VH: torch.Tensor, labels_P: torch.Tensor,
                        block_pos_P: torch.Tensor, weights_K: torch.Tensor, *, chunk_size: int) -> BlockLoss:
    """:func:`weighted_ce` from the final hidden states, ``chunk_size`` positions at a time.

    The logits ``[P, vocab]`` are the largest tensor of a step (a 150k vocabulary makes them several
    GB per sequence); each chunk's logits are recomputed in the backward pass instead of kept, so
    memory holds one chunk's logits at a time for one extra LM-head matmul.
    """
    weights_P = _supervised_weights(labels_P, block_pos_P, weights_K)
    total, hits_P = _ChunkedHeadCE.apply(hidden_PH, head_VH, labels_P, weights_P, chunk_size)
    weight_total, correct_K, count_K = _counts(hits_P, labels_P, block_pos_P, weights_P, weights_K.numel())
    return BlockLoss(weighted_sum=total, weight_total=weight_total, correct_K=correct_K, count_K=count_K)
