"""The EAGLE-3 loss: forward KL (soft cross-entropy) against the target's own distribution.

The target's logits come from its final-norm hidden state and its frozen LM head, restricted to the
draft vocabulary and softmaxed: ``p = softmax(z[t2d])``. A position counts only where the target's
choice (the argmax over its whole vocabulary) lies in the draft vocabulary; there the drafter
could not have matched it. TTT step ``k`` weighs ``loss_decay ** k``; the loss of a step is the
weighted sum over every supervised (step, position) divided by the sum of their weights, so a
training step can add the two up over micro-batches and ranks before dividing (as DFlash does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def step_weights(ttt_steps: int, loss_decay: float) -> list[float]:
    return [loss_decay ** k for k in range(ttt_steps)]


@dataclass
class TargetProbs:
    """The target's distribution over the draft vocabulary at every position of a micro-batch."""
    probs_BSV: torch.Tensor    # [B, S, draft_vocab] float32
    in_vocab_BS: torch.Tensor  # [B, S] bool: the target's argmax at (b, j) is a draft token


@torch.no_grad()
def target_probs(final_BSH: torch.Tensor, head_VH: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, *,
                 chunk_size: int) -> TargetProbs:
    """Target logits ``final @ head.T`` at every position, ``chunk_size`` rows at a time (the
    full-vocabulary logits of a sequence would be the largest tensor of a step), restricted to the
    draft vocabulary (``draft_ids``: its target ids) and softmaxed. Every position, not only those
    some step is trained against: selecting those would read their count on the host."""
    batch, seq_len, hidden = final_BSH.shape
    finals = final_BSH.reshape(batch * seq_len, hidden)
    probs = torch.empty(finals.shape[0], draft_ids.numel(), dtype=torch.float32, device=final_BSH.device)
    in_vocab = torch.empty(finals.shape[0], dtype=torch.bool, device=final_BSH.device)
    for start in range(0, finals.shape[0], chunk_size):
        logits = F.linear(finals[start:start + chunk_size].to(head_VH.dtype), head_VH).float()
        in_vocab[start:start + chunk_size] = t2d[logits.argmax(-1)]
        probs[start:start + chunk_size] = logits[:, draft_ids].softmax(-1)
    return TargetProbs(probs_BSV=probs.view(batch, seq_len, -1), in_vocab_BS=in_vocab.view(batch, seq_len))


def soft_ce(logits_PV: torch.Tensor, probs_PV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over positions of ``-sum_v p log q``, top-1 hits: the drafter's argmax is the target's)."""
    logq = F.log_softmax(logits_PV.float(), dim=-1)
    hits = (logits_PV.detach().argmax(-1) == probs_PV.argmax(-1)).long()
    return -(probs_PV * logq).sum(), hits


def _chunk_soft_ce(normed_CH, head_VH, probs_CV, supervised_C):
    logits = F.linear(normed_CH.to(head_VH.dtype), head_VH)
    logq = F.log_softmax(logits.float(), dim=-1)
    ce = torch.where(supervised_C, -(probs_CV * logq).sum(-1), 0.0)
    hits = (logits.detach().argmax(-1) == probs_CV.argmax(-1)) & supervised_C
    return ce.sum(), hits.sum()


def soft_ce_chunked(normed_PH: torch.Tensor, head_VH: torch.Tensor, probs_PV: torch.Tensor,
                    supervised_P: torch.Tensor, *, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`soft_ce` over the ``supervised`` positions, from the drafter's normed states: each
    chunk's logits are recomputed in the backward pass instead of kept. The shapes stay fixed (an
    unsupervised position weighs 0): nothing is read on the host. Returns (differentiable sum,
    number of hits), both tensors."""
    total = normed_PH.new_zeros((), dtype=torch.float32)
    hits = torch.zeros((), dtype=torch.long, device=normed_PH.device)
    for start in range(0, normed_PH.shape[0], chunk_size):
        args = (normed_PH[start:start + chunk_size], head_VH, probs_PV[start:start + chunk_size],
                supervised_P[start:start + chunk_size])
        if torch.is_grad_enabled() and normed_PH.requires_grad:
            part, part_hits = checkpoint(_chunk_soft_ce, *args, use_reentrant=False)
        else:
            part, part_hits = _chunk_soft_ce(*args)
        total = total + part
        hits = hits + part_hits
    return total, hits
