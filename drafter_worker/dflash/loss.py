"""Position-weighted cross-entropy of the draft blocks.

Block position k (1..B-1) weighs ``w_k = exp(-(k-1)/gamma)``: an early mistake ends the accepted
prefix, so the first positions matter most. The loss of a set of blocks is the weighted sum of the
CE over its supervised positions divided by the sum of their weights. :func:`weighted_ce` returns
the two parts separately so that a training step can add them up over micro-batches (and ranks)
before dividing: every supervised position of the step then counts the same, whatever micro-batch
it came in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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
    weight_total: float         # sum of w_k over the same positions
    correct_K: torch.Tensor     # [block_size] top-1 hits per block position (position 0 unused)
    count_K: torch.Tensor       # [block_size] supervised positions per block position

    @property
    def loss(self) -> float:
        return float(self.weighted_sum.detach()) / self.weight_total if self.weight_total else math.nan


def weighted_ce(logits_PV: torch.Tensor, labels_P: torch.Tensor, block_pos_P: torch.Tensor,
                weights_K: torch.Tensor) -> BlockLoss:
    """Weighted CE of ``P`` supervised positions (``labels_P`` has no ``IGNORE``).

    ``block_pos_P`` is each position's index k inside its block, ``weights_K`` from :func:`position_weights`.
    """
    assert not bool((labels_P == IGNORE).any()), "pass only supervised positions"
    block_size = weights_K.numel()
    weights_P = weights_K.to(logits_PV.device)[block_pos_P]
    ce_P = F.cross_entropy(logits_PV.float(), labels_P, reduction="none")
    hits_P = (logits_PV.detach().argmax(-1) == labels_P).long()
    correct_K = torch.zeros(block_size, dtype=torch.long, device=logits_PV.device).index_add_(0, block_pos_P, hits_P)
    count_K = torch.bincount(block_pos_P, minlength=block_size)
    return BlockLoss(weighted_sum=(ce_P * weights_P).sum(), weight_total=float(weights_P.double().sum()),
                     correct_K=correct_K.cpu(), count_K=count_K.cpu())


def _chunk_ce(hidden_CH: torch.Tensor, head_VH: torch.Tensor, labels_C: torch.Tensor,
              weights_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden_CH.to(head_VH.dtype), head_VH).float()
    hits = (logits.detach().argmax(-1) == labels_C).long()
    return (F.cross_entropy(logits, labels_C, reduction="none") * weights_C).sum(), hits


def weighted_ce_chunked(hidden_PH: torch.Tensor, head_VH: torch.Tensor, labels_P: torch.Tensor,
                        block_pos_P: torch.Tensor, weights_K: torch.Tensor, *, chunk_size: int) -> BlockLoss:
    """:func:`weighted_ce` from the final hidden states, ``chunk_size`` positions at a time.

    The logits ``[P, vocab]`` are the largest tensor of a step (a 150k vocabulary makes them several
    GB per sequence); each chunk's logits are recomputed in the backward pass instead of kept, so
    memory holds one chunk's logits at a time for one extra LM-head matmul.
    """
    block_size = weights_K.numel()
    weights_P = weights_K.to(hidden_PH.device)[block_pos_P]
    total = hidden_PH.new_zeros((), dtype=torch.float32)
    hits_P = torch.empty_like(labels_P)
    for start in range(0, labels_P.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        args = (hidden_PH[part], head_VH, labels_P[part], weights_P[part])
        if torch.is_grad_enabled() and hidden_PH.requires_grad:
            part_sum, hits_P[part] = checkpoint(_chunk_ce, *args, use_reentrant=False)
        else:
            part_sum, hits_P[part] = _chunk_ce(*args)
        total = total + part_sum
    correct_K = torch.zeros(block_size, dtype=torch.long, device=hidden_PH.device).index_add_(0, block_pos_P, hits_P)
    count_K = torch.bincount(block_pos_P, minlength=block_size)
    return BlockLoss(weighted_sum=total, weight_total=float(weights_P.double().sum()),
                     correct_K=correct_K.cpu(), count_K=count_K.cpu())
