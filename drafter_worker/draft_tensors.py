"""What a drafter model trains and exports, apart from the target's tensors it borrows.

Both drafters hold the target's embedding (DFlash its LM head too) frozen beside their own
tensors; those shared ones are never trained and never saved. :class:`DraftTensors` names the rest
once: deterministic initialisation, the trainable parameters, and the state dict written as the
exported checkpoint (buffers included: EAGLE-3's ``d2t``/``t2d``).
"""

from __future__ import annotations

import torch
from torch import nn


class DraftTensors(nn.Module):
    """A drafter model's own tensors: every one whose name does not start with ``SHARED_PREFIXES``."""

    SHARED_PREFIXES: tuple[str, ...] = ()

    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation of the trainable tensors (normal 0.02, norms at 1)."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.draft_named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    def draft_named_parameters(self):
        return [(n, p) for n, p in self.named_parameters() if not n.startswith(self.SHARED_PREFIXES)]

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter's own tensors, named as in the exported checkpoint."""
        return {n: t for n, t in self.state_dict().items() if not n.startswith(self.SHARED_PREFIXES)}

    def load_draft_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.draft_state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(f"drafter tensors do not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        self.load_state_dict(state, strict=False)
