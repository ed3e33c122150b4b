"""The training-time test: the mask and targets of each unrolled step on hand-checked examples, and
the unrolled training forward equal to the chain a drafter runs at inference."""

from __future__ import annotations

import warnings

import torch

from drafter_worker.eagle3.eval import Eagle3Proposer
from drafter_worker.eagle3.ttt import step_targets, ttt_mask
from eagle3_testing import eagle3_states, make_trainer


def test_step_k_sees_the_prefix_at_step_0_and_its_own_chain_only():
    assert ttt_mask(3, 0).int().tolist() == [[1, 0, 0],
                                            [1, 1, 0],
                                            [1, 1, 1]]
    # Keys: step 0's three positions, then step 1's, then step 2's.
    assert ttt_mask(3, 2).int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                                            [1, 1, 0, 0, 1, 0, 0, 1, 0],
                                            [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_step_k_reads_token_t_plus_1_plus_k_and_predicts_response_token_t_plus_2_plus_k():
    ids = torch.tensor([[10, 11, 12, 13, 14, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])  # tokens 2..4 are the response; 5 is padding
    seq_lens = torch.tensor([5])
    tokens, supervised = step_targets(ids, loss_mask, seq_lens, 0)
    assert tokens.tolist() == [[11, 12, 13, 14, 0, 0]]
    assert supervised.int().tolist() == [[1, 1, 1, 0, 0, 0]]  # t=0..2 predict tokens 2..4
    tokens, supervised = step_targets(ids, loss_mask, seq_lens, 2)
    assert tokens.tolist() == [[13, 14, 0, 0, 0, 0]]
    assert supervised.int().tolist() == [[1, 0, 0, 0, 0, 0]]  # only t=0 predicts a token (4) that exists


def test_unrolled_training_forward_equals_the_inference_chain(tiny_target, tiny_target_model):
    """Step k at position t of the training forward is the chain started after token t+1: the proposer,
    fed the true tokens as its drafts, computes the same hidden states."""
    trainer = make_trainer(tiny_target, ttt_steps=3)
    model = trainer.model.eval()
    torch.manual_seed(0)
    ids = torch.randint(1, 299, (1, 12))
    hs = eagle3_states(tiny_target_model, ids)[..., :3 * 64]
    seq_len = ids.shape[1]
    with torch.no_grad():
        hidden, cache, unrolled = model.fuse(hs), [], []
        positions = torch.arange(seq_len).unsqueeze(0)
        for k in range(3):
            tokens = torch.cat([ids[:, 1 + k:], ids.new_zeros(1, 1 + k)], dim=1)
            hidden, normed = model.step(hidden, tokens, positions + k, cache, ttt=True)
            unrolled.append(normed)
        t = 6  # the chain drafted from the prefix ids[:t+2], whose last token is the bonus
        chain, stream = [], None
        cache = []
        stream, normed = model.step(model.fuse(hs[:, :t + 1]), ids[:, 1:t + 2], positions[:, :t + 1], cache,
                                    ttt=True)
        chain.append(normed[0, -1])
        stream = stream[:, -1:]
        for k in range(1, 3):
            stream, normed = model.step(stream, ids[:, t + 1 + k].view(1, 1), torch.tensor([[t + k]]), cache)
            chain.append(normed[0, -1])
    for k in range(3):
        torch.testing.assert_close(chain[k], unrolled[k][0, t], atol=1e-5, rtol=1e-5)
    drafts = Eagle3Proposer(model).propose(ids[0, :t + 2], hs[0, :t + 1])
    assert drafts.shape == (3,) and bool(trainer.model.t2d[drafts].all())  # target ids of draft tokens


def test_a_micro_batch_equals_the_dense_mask_reference(tiny_target, tiny_target_model):
    """The step without a dense mask and without selecting the supervised positions: the same loss,
    weight, counts and gradients as the dense reference (tests/eagle3_reference.py)."""
    from eagle3_reference import reference_micro_batch
    from eagle3_testing import random_batch
    for seq_len, seed in ((16, 1), (23, 2)):
        batch = random_batch(tiny_target_model, batch=3, seq_len=seq_len, seed=seed)
        trainer, reference = (make_trainer(tiny_target, ttt_steps=4, loss_chunk_size=7) for _ in range(2))
        stats = trainer.micro_batch(*batch)
        weighted_sum, weight, counts = reference_micro_batch(reference, *batch)
        assert stats.count == counts and stats.weight == weight and all(n > 0 for n in counts[:3])
        assert abs(float(stats.weighted_sum) - weighted_sum) <= 1e-5 * abs(weighted_sum)
        for (name, p), (_, r) in zip(trainer.model.draft_named_parameters(), reference.model.draft_named_parameters()):
            torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_ttt_attention_kernels_equal_the_dense_mask():
    """Flex attention with the cached block mask (eager here) and the structured scores, against SDPA
    over every key with the dense TTT mask, for each step."""
    import torch.nn.functional as F

    from drafter_worker.eagle3.ttt_attention import ttt_attention
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq_len, dim = 2, 4, 2, 10, 8
    q = torch.randn(batch, heads, seq_len, dim, generator=g)
    cache = []
    for step in range(4):
        cache.append((torch.randn(batch, kv_heads, seq_len, dim, generator=g),
                      torch.randn(batch, kv_heads, seq_len, dim, generator=g)))
        keys = torch.cat([k for k, _ in cache], dim=2).repeat_interleave(2, dim=1)
        values = torch.cat([v for _, v in cache], dim=2).repeat_interleave(2, dim=1)
        dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=ttt_mask(seq_len, step))
        torch.testing.assert_close(ttt_attention(q, cache, kind="structured"), dense, atol=1e-5, rtol=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex attention warns that it is unfused
            flex = ttt_attention(q, cache, kind="flex", compiled=False)
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
