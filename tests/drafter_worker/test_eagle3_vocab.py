"""The EAGLE-3 draft vocabulary on hand-checked counts: what is chosen, and d2t/t2d both ways."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter_worker.eagle3.vocab import (check_vocab, count_response_tokens, draft_to_target,
                                         draft_vocab_from_counts, target_to_draft)


def test_counts_only_response_tokens():
    tokens = np.array([5, 1, 1, 2, 5, 5, 0], dtype=np.uint32)
    mask = np.array([1, 0, 1, 1, 1, 0, 1], dtype=np.uint8)
    assert count_response_tokens(tokens, mask, 6).tolist() == [1, 1, 1, 0, 0, 2]
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        count_response_tokens(tokens, mask, 5)


def test_most_frequent_tokens_in_id_order_and_the_round_trip():
    counts = np.array([0, 7, 3, 3, 0, 9, 1, 0])  # ids by count: 5, 1, then 2 and 3 tied (lower id first)
    d2t, t2d = draft_vocab_from_counts(counts, 4)
    assert t2d.tolist() == [False, True, True, True, False, True, False, False]
    # Draft ids 0..3 are target ids 1, 2, 3, 5: d2t holds the offsets.
    assert (d2t.dtype, d2t.tolist()) == (torch.int64, [1, 1, 1, 2])
    assert draft_to_target(torch.arange(4), d2t).tolist() == [1, 2, 3, 5]
    assert target_to_draft(torch.arange(8), t2d).tolist() == [-1, 0, 1, 2, -1, 3, -1, -1]
    assert target_to_draft(draft_to_target(torch.arange(4), d2t), t2d).tolist() == [0, 1, 2, 3]
    check_vocab(d2t, t2d)


def test_unseen_tokens_fill_a_vocabulary_larger_than_the_seen_ones():
    d2t, t2d = draft_vocab_from_counts(np.array([0, 0, 4, 0, 2]), 3)
    assert draft_to_target(torch.arange(3), d2t).tolist() == [0, 2, 4]  # 2 and 4 seen, then id 0
    assert int(t2d.sum()) == 3
    with pytest.raises(ValueError, match="draft vocabulary of 6"):
        draft_vocab_from_counts(np.zeros(5), 6)


def test_mismatched_mappings_are_refused():
    d2t, t2d = draft_vocab_from_counts(np.array([3, 2, 1, 0]), 2)
    other = t2d.clone()
    other[[1, 3]] = torch.tensor([False, True])
    with pytest.raises(ValueError, match="d2t does not map"):
        check_vocab(d2t, other)
