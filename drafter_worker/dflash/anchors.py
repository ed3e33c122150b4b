"""Where the draft blocks of a training sequence start, and what each block must predict.

An anchor ``a`` is a position whose token and next token are both response tokens (``loss_mask``
set at ``a`` and ``a+1``, ``a+1 < seq_len``): the block put there starts from a real response
token and has at least one supervised label. Anchors are drawn fresh on every call (without
replacement, from a generator the trainer owns and checkpoints), so over an epoch every position
serves as an anchor in some step. The block at ``a`` predicts tokens ``a+1 .. a+B-1``; labels past
the sequence or outside the loss mask are ``IGNORE``.

The draw runs on the loss mask's device with tensor operations only: it never reads a count back to
the host, and its result has a width fixed by the shapes (``min(num_anchors, S - 1)``), so a bucket's
micro-batches all have the same shapes. Sequences with fewer eligible positions are padded.
"""

from __future__ import annotations

import torch

IGNORE = -100
PAD_ANCHOR = -1  # marks an unused slot of the padded [batch, num_blocks] anchor tensor


def eligible_anchors(loss_mask_S: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions ``a < seq_len - 1`` with ``loss_mask[a]`` and ``loss_mask[a+1]`` set (1-D, ascending)."""
    mask = loss_mask_S[:seq_len].bool()
    if seq_len < 2:
        return torch.zeros(0, dtype=torch.long, device=loss_mask_S.device)
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def anchor_width(seq_len_max: int, num_anchors: int) -> int:
    """Columns of the drawn ``[batch, N]`` anchors: no sequence of ``seq_len_max`` tokens has more
    than ``seq_len_max - 1`` eligible positions (at least one column, so that shapes stay valid)."""
    return max(1, min(num_anchors, seq_len_max - 1))


def sample_anchors(loss_mask_BS: torch.Tensor, seq_lens_B: torch.Tensor, *, num_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Up to ``num_anchors`` anchors per sequence, ascending, padded with ``PAD_ANCHOR`` to
    ``[batch, anchor_width(S, num_anchors)]``, drawn uniformly without replacement.

    Each position gets a uniform key from ``generator`` (which must live on the loss mask's device;
    the keys depend on it and the shapes only, not on the data); the eligible positions with the
    smallest keys are the anchors. The same generator state gives the same anchors on a device.
    """
    batch, seq_len_max = loss_mask_BS.shape
    device = loss_mask_BS.device
    width = anchor_width(seq_len_max, num_anchors)
    if seq_len_max < 2:
        return torch.full((batch, width), PAD_ANCHOR, dtype=torch.long, device=device)
    mask = loss_mask_BS.bool()
    positions = torch.arange(seq_len_max - 1, device=device)
    eligible = mask[:, :-1] & mask[:, 1:] & (positions + 1 < seq_lens_B.view(-1, 1).to(device))
    keys = torch.rand(batch, seq_len_max - 1, generator=generator, device=device)
    keys = keys.masked_fill(~eligible, 2.0)  # above every uniform key: drawn only once the eligible run out
    smallest, chosen = keys.topk(width, dim=1, largest=False)
    # Unused columns sort to the end (past every position), then become PAD_ANCHOR.
    chosen = torch.where(smallest < 2.0, chosen, seq_len_max).sort(dim=1).values
    return torch.where(chosen < seq_len_max, chosen, PAD_ANCHOR)


def check_anchors(anchors_BN: torch.Tensor, loss_mask_BS: torch.Tensor, seq_lens_B: torch.Tensor) -> None:
    """Pinned anchors must be eligible: a user passing wrong ones gets a clear error, not a silent loss.

    It reads the anchors and the loss mask on the host: pinning anchors is for tests and checks,
    not for the training loop, whose anchors :func:`sample_anchors` draws."""
    for i, (row, seq_len) in enumerate(zip(anchors_BN.tolist(), seq_lens_B.tolist())):
        allowed = set(eligible_anchors(loss_mask_BS[i].detach().cpu(), int(seq_len)).tolist())
        bad = [a for a in row if a != PAD_ANCHOR and a not in allowed]
        if bad:
            raise ValueError(f"sequence {i}: anchors {bad} are not eligible (need loss_mask at a and a+1, "
                             f"a+1 < seq_len={seq_len})")


def block_labels(input_ids_BS: torch.Tensor, loss_mask_BS: torch.Tensor, seq_lens_B: torch.Tensor,
                 anchors_BN: torch.Tensor, block_size: int) -> torch.Tensor:
    """Labels ``[B, N, block_size]``: ``input_ids[a+k]`` at block position k, ``IGNORE`` where unsupervised.

    Position 0 (the anchor itself) is always ``IGNORE``, as are the blocks of padded anchors.
    """
    seq_len_max = input_ids_BS.shape[1]
    offsets = torch.arange(block_size, device=anchors_BN.device)
    pos = anchors_BN.unsqueeze(-1) + offsets  # [B, N, block]
    valid = (anchors_BN != PAD_ANCHOR).unsqueeze(-1) & (offsets > 0)
    valid &= pos < seq_lens_B.view(-1, 1, 1).to(pos.device)
    safe = pos.clamp(0, seq_len_max - 1).flatten(1)
    tokens = torch.gather(input_ids_BS, 1, safe).view_as(pos)
    supervised = torch.gather(loss_mask_BS.bool(), 1, safe).view_as(pos)
    return torch.where(valid & supervised, tokens, torch.full_like(tokens, IGNORE))
