"""The EAGLE-3 draft vocabulary: the target tokens the drafter's LM head scores.

The drafter predicts only the ``draft_vocab`` tokens the target says most often in the training
responses (loss-mask positions): a 32k head instead of a 150k one, for almost all of the
probability mass. Serving engines take the subset as two tensors saved with the weights:

* ``d2t`` int64 ``[draft_vocab]``: target id = draft id + ``d2t[draft id]`` (an offset, not the id);
* ``t2d`` bool ``[target_vocab]``: whether a target token is in the draft vocabulary.

Draft ids follow the target ids' order, so ``d2t`` never decreases and the two are each other's
inverse. Counting is deterministic (ties go to the lower id): every rank of a group, and a resumed
run, computes the same vocabulary from the same dataset.
"""

from __future__ import annotations

import numpy as np
import torch

# Tokens counted per pass over the memory-mapped dataset (bounds the counting's memory).
COUNT_CHUNK_TOKENS = 1 << 24


def count_response_tokens(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 ``[vocab_size]``: how often each token appears where the loss mask is set."""
    if len(tokens) != len(loss_mask):
        raise ValueError(f"{len(tokens)} tokens but a loss mask of {len(loss_mask)}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), COUNT_CHUNK_TOKENS):
        chunk = np.asarray(tokens[start:start + COUNT_CHUNK_TOKENS])
        chunk = chunk[np.asarray(loss_mask[start:start + COUNT_CHUNK_TOKENS]) != 0].astype(np.int64)
        if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab_size):
            raise ValueError(f"token ids outside the target's vocabulary of {vocab_size}: not its tokenizer's data")
        counts += np.bincount(chunk, minlength=vocab_size)
    return counts


def draft_vocab_from_counts(counts: np.ndarray | torch.Tensor, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of the ``draft_vocab`` most frequent tokens (ties and unseen tokens: lower id first)."""
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.int64)
    vocab_size = counts.numel()
    if not 0 < draft_vocab <= vocab_size:
        raise ValueError(f"draft vocabulary of {draft_vocab} tokens for a target vocabulary of {vocab_size}")
    # A stable sort on -count keeps equal counts in id order.
    order = torch.sort(-counts, stable=True).indices[:draft_vocab]
    target_ids = torch.sort(order).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    d2t = target_ids - torch.arange(draft_vocab, dtype=torch.int64)
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of ``target_ids``; -1 for tokens outside the draft vocabulary."""
    draft_index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], draft_index[target_ids], torch.full_like(target_ids, -1))


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError unless ``d2t`` and ``t2d`` describe the same subset (as a loaded checkpoint must)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or int(t2d.sum()) != d2t.numel():
        raise ValueError(f"d2t ({d2t.dtype}, {d2t.numel()}) and t2d ({t2d.dtype}, {int(t2d.sum())} set) do not match")
    target_ids = d2t + torch.arange(d2t.numel())
    if not bool((target_ids[1:] > target_ids[:-1]).all()) or not bool(t2d[target_ids].all()):
        raise ValueError("d2t does not map the draft ids onto the tokens t2d marks, in ascending order")
