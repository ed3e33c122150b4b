"""The EAGLE-3 loss on hand-checked numbers, and a training step that is a fixed function of its inputs."""

from __future__ import annotations

import math

import torch

from drafter_worker.eagle3.loss import soft_ce, soft_ce_chunked, step_weights, target_probs
from drafter_worker.eagle3.ttt import step_targets
from drafter_worker.eagle3.vocab import draft_vocab_from_counts
from eagle3_testing import random_batch, make_trainer


def test_soft_cross_entropy_by_hand():
    # q = softmax([0, ln 3]) = [1/4, 3/4]; against p = [1/4, 3/4] the CE is the entropy of p.
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    probs = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    total, hits = soft_ce(logits, probs)
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert math.isclose(total.item(), entropy + math.log(2.0), rel_tol=1e-6)  # row 2: -log(1/2)
    assert hits.tolist() == [1, 1]  # argmax 1 vs 1; a tie takes index 0 on both sides
    chunked, num_hits = soft_ce_chunked(torch.eye(2), logits.T.contiguous(), probs, torch.tensor([True, True]),
                                        chunk_size=1)
    assert math.isclose(chunked.item(), total.item(), rel_tol=1e-6) and num_hits.item() == 2
    only_first, first_hits = soft_ce_chunked(torch.eye(2), logits.T.contiguous(), probs, torch.tensor([True, False]),
                                             chunk_size=1)  # an unsupervised position weighs nothing
    assert math.isclose(only_first.item(), entropy, rel_tol=1e-6) and first_hits.item() == 1
    assert step_weights(3, 0.8) == [1.0, 0.8, 0.8 ** 2]


def test_target_distribution_is_restricted_to_the_draft_vocabulary_and_masked_by_its_argmax():
    d2t, t2d = draft_vocab_from_counts(torch.tensor([5, 0, 4, 3]), 3)  # draft tokens: target ids 0, 2, 3
    head = torch.eye(4)  # the target's logits are the final states themselves
    final = torch.tensor([[[0.0, 0.0, math.log(3.0), 0.0],      # argmax 2: in the draft vocabulary
                           [0.0, 5.0, 0.0, 0.0],                # argmax 1: not a draft token
                           [1.0, 1.0, 1.0, 1.0]]])              # not needed
    target = target_probs(final, head, t2d.nonzero().squeeze(1), t2d, chunk_size=2)
    torch.testing.assert_close(target.probs_BSV[0, 0], torch.tensor([0.2, 0.6, 0.2]))  # softmax of [0, ln 3, 0]
    assert target.probs_BSV.shape == (1, 3, 3)
    assert target.in_vocab_BS.tolist() == [[True, False, True]]  # the last: a tie, taken by target id 0


def test_a_step_is_deterministic_and_the_loss_weighs_steps_by_decay(tiny_target, tiny_target_model):
    batch = random_batch(tiny_target_model, batch=2, seq_len=16, seed=3)
    a, b = make_trainer(tiny_target, loss_decay=0.5), make_trainer(tiny_target, loss_decay=0.5)
    first, second = a.micro_batch(*batch), b.micro_batch(*batch)
    assert first.loss == second.loss and first.count == second.count
    # The accuracy counts every position a step predicts, as a served drafter is judged (SpecForge's
    # denominator): one whose target token is outside the draft vocabulary is a miss. The loss weighs
    # only the in-vocabulary ones: sum_k 0.5^k x (in-vocabulary positions of step k).
    _, input_ids, loss_mask, seq_lens = batch
    predicted = [int(step_targets(input_ids, loss_mask.bool(), seq_lens, k)[1].sum()) for k in range(3)]
    assert first.count == predicted and all(n > 0 for n in predicted)
    trained = first.weight
    assert 0 < trained < sum(0.5 ** k * n for k, n in enumerate(predicted))  # some target tokens are not draft tokens
    assert all(hits <= n for hits, n in zip(first.correct, first.count))
    a.apply_step()
    b.apply_step()
    for (name, pa), (_, pb) in zip(a.model.draft_named_parameters(), b.model.draft_named_parameters()):
        assert torch.equal(pa, pb), name
    for _ in range(8):
        a.micro_batch(*batch)
        a.apply_step()
    assert a.micro_batch(*batch).loss < first.loss - 0.1
