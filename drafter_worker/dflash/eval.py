"""DFlash drafting for :func:`drafter_worker.speculative_eval.evaluate` (``hsd eval``).

From the verified prefix (its last token the target's bonus token) and the target's captured layers
of every position but the last: one block anchored at the last token, whose ``block_size - 1``
masked positions are drafted in one forward under the block mask training uses. The target then
verifies the drafts greedily.
"""

from __future__ import annotations

import os

import torch

from drafter_worker.dflash.model import DFlashDraftModel


class DFlashProposer:
    """A :class:`drafter_worker.speculative_eval.Proposer` drafting one block anchored at the last accepted token."""

    def __init__(self, model: DFlashDraftModel):
        self.model = model.eval()
        self.block_size = model.config.block_size
        self.target_layer_ids = list(model.config.target_layer_ids)

    @torch.no_grad()
    def propose(self, seq_ids: torch.Tensor, ctx_hs: torch.Tensor) -> torch.Tensor:
        # The anchor's own row is padding: the mask only lets the block see positions before it.
        hs = torch.cat([ctx_hs, ctx_hs.new_zeros(1, ctx_hs.shape[-1])]).unsqueeze(0)
        anchor = torch.tensor([[len(seq_ids) - 1]], device=seq_ids.device)
        hidden = self.model(hs, seq_ids.unsqueeze(0), anchor)
        return self.model.logits(hidden[0, 0, 1:]).argmax(-1)


def load_proposer(drafter_dir: str | os.PathLike, target_dir, *, device="cpu") -> DFlashProposer:
    """An exported DFlash drafter (or a checkpoint's step directory), drafting on ``device``."""
    from drafter_worker.dflash.export import load_drafter
    return DFlashProposer(load_drafter(drafter_dir, target_dir, device=device))
