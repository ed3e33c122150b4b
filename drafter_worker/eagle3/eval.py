"""EAGLE-3 chain drafting for :func:`drafter_worker.speculative_eval.evaluate` (``hsd eval``).

From the verified prefix ``x_0..x_{L-1}`` (``x_{L-1}`` the target's bonus token) and the target's
captured layers of positions ``0..L-2``: step 0 runs over every position ``t`` with token
``x_{t+1}`` and ``fc(h_t)`` under a causal mask, and its output at the last position drafts the
first token; each later step feeds the drafted token and the last position's own hidden output
back in, one position further (RoPE), attending to every key so far. ``ttt_steps`` drafts in all,
each mapped to a target id through ``d2t``; the target then verifies them greedily.
"""

from __future__ import annotations

import os

import torch

from drafter_worker.eagle3.model import Eagle3DraftModel
from drafter_worker.eagle3.vocab import draft_to_target


class Eagle3Proposer:
    """A :class:`drafter_worker.speculative_eval.Proposer` drafting ``ttt_steps`` tokens by chaining."""

    def __init__(self, model: Eagle3DraftModel):
        self.model = model.eval()
        self.num_drafts = model.config.ttt_steps
        self.block_size = self.num_drafts + 1  # the bonus token plus the drafts, as DFlash counts its blocks
        self.target_layer_ids = list(model.config.target_layer_ids)

    def _to_target(self, normed_H: torch.Tensor) -> torch.Tensor:
        draft_id = self.model.logits(normed_H).argmax(-1)
        return draft_to_target(draft_id, self.model.d2t)

    @torch.no_grad()
    def propose(self, seq_ids: torch.Tensor, ctx_hs: torch.Tensor) -> torch.Tensor:
        model, num_ctx = self.model, len(seq_ids) - 1
        cache: list = []
        positions = torch.arange(num_ctx, device=seq_ids.device).unsqueeze(0)
        stream, normed = model.step(model.fuse(ctx_hs.unsqueeze(0)), seq_ids[1:].unsqueeze(0), positions, cache,
                                    ttt=True)  # step 0: causal over the prefix
        drafts = [self._to_target(normed[0, -1])]
        stream = stream[:, -1:]
        for k in range(1, self.num_drafts):
            position = torch.tensor([[num_ctx - 1 + k]], device=seq_ids.device)
            stream, normed = model.step(stream, drafts[-1].view(1, 1), position, cache)
            drafts.append(self._to_target(normed[0, -1]))
        return torch.stack(drafts)


def load_proposer(drafter_dir: str | os.PathLike, target_dir, *, device="cpu") -> Eagle3Proposer:
    """An exported EAGLE-3 drafter, drafting on ``device``."""
    from drafter_worker.eagle3.export import load_drafter
    return Eagle3Proposer(load_drafter(drafter_dir, target_dir, device=device))
