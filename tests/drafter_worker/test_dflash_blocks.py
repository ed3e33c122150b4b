"""The pieces checked by hand: block mask, anchor eligibility, labels, loss weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from drafter_worker.dflash.anchors import (IGNORE, PAD_ANCHOR, block_labels, check_anchors, eligible_anchors,
                                           sample_anchors)
from drafter_worker.dflash.config import ConfigError, DFlashTrainConfig, default_gamma
from drafter_worker.dflash.loss import position_weights, weighted_ce
from drafter_worker.dflash.mask import block_mask_predicate, block_positions, dense_block_mask


def test_dense_mask_pinned_on_a_hand_checked_example():
    # 5 context positions, blocks of 2 anchored at 1 and 3; keys = ctx 0..4, block 0 (5, 6), block 1 (7, 8).
    mask = dense_block_mask(torch.tensor([[1, 3]]), ctx_len=5, block_size=2)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0 sees ctx < 1 and its own block
        [1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],  # block 1 sees ctx < 3 and its own block, never block 0
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert mask.shape == (1, 1, 4, 9)
    assert torch.equal(mask[0, 0], expected)


def test_padded_anchor_sees_only_its_own_block_and_batches_are_independent():
    mask = dense_block_mask(torch.tensor([[2, PAD_ANCHOR], [0, 1]]), ctx_len=3, block_size=2)
    assert torch.equal(mask[0, 0, 2:], torch.tensor([[0, 0, 0, 0, 0, 1, 1]] * 2, dtype=torch.bool))
    assert torch.equal(mask[0, 0, :2], torch.tensor([[1, 1, 0, 1, 1, 0, 0]] * 2, dtype=torch.bool))
    # Anchor 0 has no context at all, only its block: no query row is ever fully masked.
    assert torch.equal(mask[1, 0, :2], torch.tensor([[0, 0, 0, 1, 1, 0, 0]] * 2, dtype=torch.bool))
    assert bool(mask.any(-1).all())


def test_predicate_is_the_same_rule_pointwise():
    anchors = torch.tensor([[4, 1, 6]])
    mask_mod = block_mask_predicate(anchors, ctx_len=8, block_size=3)
    dense = dense_block_mask(anchors, ctx_len=8, block_size=3)[0, 0]
    for q in range(9):
        for kv in range(17):
            got = bool(mask_mod(torch.tensor(0), None, torch.tensor(q), torch.tensor(kv)))
            assert got == bool(dense[q, kv])


def test_block_positions_are_absolute():
    assert block_positions(torch.tensor([[3, 7]]), 3).tolist() == [[3, 4, 5, 7, 8, 9]]


def test_anchor_eligibility_on_a_hand_made_loss_mask():
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert eligible_anchors(loss_mask, 9).tolist() == [1, 2, 5]  # 8 has no next token
    assert eligible_anchors(loss_mask, 6).tolist() == [1, 2]     # a + 1 must be inside the sequence
    assert eligible_anchors(loss_mask, 1).tolist() == []


def test_sampling_without_replacement_redraws_and_respects_the_limit():
    loss_mask = torch.ones(2, 20, dtype=torch.bool)
    seq_lens = torch.tensor([20, 6])
    g = torch.Generator().manual_seed(0)
    first = sample_anchors(loss_mask, seq_lens, num_anchors=8, generator=g)
    second = sample_anchors(loss_mask, seq_lens, num_anchors=8, generator=g)
    assert first.shape == (2, 8)
    assert len(set(first[0].tolist())) == 8 and all(0 <= a < 19 for a in first[0].tolist())
    assert first[1].tolist() == [0, 1, 2, 3, 4, PAD_ANCHOR, PAD_ANCHOR, PAD_ANCHOR]  # all 5 eligible, padded
    assert not torch.equal(first[0], second[0])  # re-drawn every call
    again = sample_anchors(loss_mask, seq_lens, num_anchors=8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first, again)  # and reproducible from the generator's state


def test_drawn_anchors_are_eligible_distinct_and_as_many_as_allowed():
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.rand(4, 30, generator=g) < 0.6
    seq_lens = torch.tensor([30, 25, 9, 1])
    anchors = sample_anchors(loss_mask, seq_lens, num_anchors=6, generator=g)
    assert anchors.shape == (4, 6)  # the width is fixed by the shapes, whatever the data
    check_anchors(anchors, loss_mask, seq_lens)
    for row, mask, n in zip(anchors.tolist(), loss_mask, seq_lens.tolist()):
        drawn = [a for a in row if a != PAD_ANCHOR]
        assert drawn == sorted(set(drawn)) and row[len(drawn):] == [PAD_ANCHOR] * (6 - len(drawn))
        assert len(drawn) == min(6, len(eligible_anchors(mask, n)))
    assert sample_anchors(loss_mask[:, :1], seq_lens.clamp(max=1), num_anchors=6, generator=g).tolist() == [[-1]] * 4


def test_pinned_anchors_must_be_eligible():
    loss_mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    check_anchors(torch.tensor([[1, 2, PAD_ANCHOR]]), loss_mask, torch.tensor([4]))
    with pytest.raises(ValueError, match=r"anchors \[0\] are not eligible"):
        check_anchors(torch.tensor([[0, 1]]), loss_mask, torch.tensor([4]))


def test_labels_skip_the_anchor_the_sequence_end_and_unmasked_tokens():
    ids = torch.arange(10, 20).unsqueeze(0)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    labels = block_labels(ids, loss_mask, torch.tensor([9]), torch.tensor([[1, 5, 8, PAD_ANCHOR]]), 3)
    assert labels.tolist() == [[
        [IGNORE, 12, 13],          # anchor 1 predicts tokens 2 and 3
        [IGNORE, 16, IGNORE],      # token 7 is outside the loss mask
        [IGNORE, IGNORE, IGNORE],  # 9 and 10 are past seq_len = 9
        [IGNORE, IGNORE, IGNORE],  # padded anchor
    ]]


def test_position_weights_by_hand():
    w = position_weights(4, 2.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    with pytest.raises(ConfigError, match="set gamma explicitly"):
        default_gamma(6)


def test_weighted_ce_by_hand():
    # Position k=1: logits [1,0,0,0], label 0; position k=3: logits [2,0,0,0], label 1.
    logits = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0]])
    result = weighted_ce(logits, torch.tensor([0, 1]), torch.tensor([1, 3]), position_weights(4, 2.0))
    ce1 = math.log(1 + 3 * math.exp(-1))        # -log(e / (e + 3))
    ce3 = math.log(math.exp(2) + 3)             # -log(1 / (e^2 + 3))
    w3 = math.exp(-1.0)
    assert float(result.weighted_sum) == pytest.approx(ce1 + w3 * ce3, rel=1e-6)
    assert result.weight_total == pytest.approx(1 + w3)
    assert result.loss == pytest.approx((ce1 + w3 * ce3) / (1 + w3), rel=1e-6)
    assert result.correct_K.tolist() == [0, 1, 0, 0] and result.count_K.tolist() == [0, 1, 0, 1]
    assert float(F.cross_entropy(logits[:1], torch.tensor([0]))) == pytest.approx(ce1, rel=1e-6)


def test_loss_with_explicit_anchors_is_deterministic(tiny_target, tiny_target_model):
    from dflash_testing import make_trainer, random_batch
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=2, seq_len=20, seed=3)
    anchors = torch.tensor([[4, 9, 15], [5, 6, PAD_ANCHOR]])
    trainer = make_trainer(tiny_target)
    first = trainer.micro_batch(hs, ids, loss_mask, seq_lens, anchors=anchors)
    trainer.drop_step()
    second = trainer.micro_batch(hs, ids, loss_mask, seq_lens, anchors=anchors)
    assert first.loss == second.loss and first.weight == second.weight
    assert first.num_blocks == 5 and first.num_positions == 5 * 3


def test_train_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="total_steps"):
        DFlashTrainConfig(total_steps=0).validate()
    with pytest.raises(ConfigError, match="attention"):
        DFlashTrainConfig(total_steps=10, attention="xformers").validate()


def test_chunked_loss_equals_the_plain_one_with_gradients():
    from drafter_worker.dflash.loss import weighted_ce_chunked
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, requires_grad=True)
    head = torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (11,), generator=g)
    block_pos = torch.randint(1, 4, (11,), generator=g)
    weights = position_weights(4, 2.0)
    plain = weighted_ce(hidden @ head.T, labels, block_pos, weights)
    (expected_grad,) = torch.autograd.grad(plain.weighted_sum, hidden)
    chunked = weighted_ce_chunked(hidden, head, labels, block_pos, weights, chunk_size=4)
    (grad,) = torch.autograd.grad(chunked.weighted_sum, hidden)
    torch.testing.assert_close(chunked.weighted_sum, plain.weighted_sum)
    torch.testing.assert_close(grad, expected_grad)
    assert chunked.weight_total == plain.weight_total
    assert torch.equal(chunked.correct_K, plain.correct_K) and torch.equal(chunked.count_K, plain.count_K)
