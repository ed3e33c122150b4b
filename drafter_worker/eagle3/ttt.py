"""The training-time test (TTT): what each unrolled step of an EAGLE-3 drafter sees and predicts.

At inference the drafter chains: from the verified prefix (whose drafter keys come from the
target's hidden states) it drafts a token, feeds that token and its own hidden output back in, and
drafts the next. Training unrolls the same chain from every position ``t`` of a sequence at once,
``ttt_steps`` times, the positions side by side:

* step 0 at position ``t`` reads token ``x[t+1]`` and the fused target state ``fc(h_t)``; step
  ``k > 0`` reads token ``x[t+1+k]`` and the drafter's own hidden output of step ``k-1`` at ``t``;
* step ``k`` predicts token ``t+2+k``, against the target's distribution at position ``t+1+k``;
* its query at ``t`` (RoPE position ``t+k``) attends to the step-0 keys at positions ``<= t`` (the
  prefix the chain started from) and to the keys of steps ``1..k`` at ``t`` alone (the chain's
  earlier drafts); never to another position's chain.
"""

from __future__ import annotations

import torch


def ttt_mask(seq_len: int, step: int, *, device=None) -> torch.Tensor:
    """Bool ``[seq_len, (step + 1) * seq_len]``, True where step ``step``'s query ``t`` may attend: keys
    are ``step + 1`` blocks of ``seq_len`` (step 0's, then one block per later step). The rule as a
    dense mask, the reference of the tests; training computes it without one
    (:mod:`drafter_worker.eagle3.ttt_attention`)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    own_chain = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own_chain] * step, dim=1)


def shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """``x[:, t + by]`` at ``t`` (``fill`` past the end), along dim 1."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by, *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def step_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: torch.Tensor, step: int):
    """(input tokens ``[B, S]``, supervised ``[B, S]`` bool) of TTT step ``step``: position ``t`` reads
    ``x[t+1+step]`` and is supervised when token ``t+2+step`` exists and is a response token."""
    seq_len = input_ids.shape[1]
    positions = torch.arange(seq_len, device=input_ids.device)
    predicted = positions + 2 + step
    exists = predicted.unsqueeze(0) < seq_lens.unsqueeze(1)
    supervised = exists & shift_left(loss_mask.bool(), 2 + step, fill=False)
    return shift_left(input_ids, 1 + step), supervised
