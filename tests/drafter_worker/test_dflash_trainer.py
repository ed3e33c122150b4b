"""The training step: the weighting rule across micro-batches, resume, and a short overfit."""

from __future__ import annotations

import math

import torch

from dflash_testing import make_trainer, random_batch
from drafter_worker.dflash.anchors import IGNORE, PAD_ANCHOR, block_labels
from drafter_worker.dflash.loss import weighted_ce
from drafter_worker.state_io import load_state, save_state
from drafter_worker.dflash.trainer import warmup_cosine


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.draft_named_parameters()}


def test_two_micro_batches_equal_one_pass_over_the_concatenated_batch(tiny_target, tiny_target_model):
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=3, seq_len=24, seed=7)
    anchors = torch.tensor([[4, 10, 17, 20], [6, 7, PAD_ANCHOR, PAD_ANCHOR], [5, 9, 14, PAD_ANCHOR]])
    split = make_trainer(tiny_target, seed=1, loss_chunk_size=7)  # chunking must not change anything either
    first = split.micro_batch(hs[:2], ids[:2], loss_mask[:2], seq_lens[:2], anchors=anchors[:2])
    second = split.micro_batch(hs[2:], ids[2:], loss_mask[2:], seq_lens[2:], anchors=anchors[2:, :3])
    split_stats = split.apply_step()

    whole = make_trainer(tiny_target, seed=1)
    whole.micro_batch(hs, ids, loss_mask, seq_lens, anchors=anchors)
    whole_stats = whole.apply_step()

    # The micro-batches differ in size, so a mean of their two losses would not be the step's loss.
    assert first.weight != second.weight
    assert abs((first.loss + second.loss) / 2 - whole_stats.loss) > 1e-4
    assert math.isclose(split_stats.loss, whole_stats.loss, rel_tol=1e-6)
    assert math.isclose(split_stats.weight, whole_stats.weight, rel_tol=1e-9)
    assert math.isclose(split_stats.grad_norm, whole_stats.grad_norm, rel_tol=1e-5)
    for name, p in _params(split).items():
        torch.testing.assert_close(p, _params(whole)[name], atol=1e-6, rtol=1e-5)


def test_apply_step_divides_by_an_explicit_total(tiny_target, tiny_target_model):
    # A data-parallel group passes the summed total: twice the local one halves the gradients.
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=2, seq_len=16, seed=8)
    anchors = torch.tensor([[4, 8], [5, PAD_ANCHOR]])
    trainer = make_trainer(tiny_target, grad_clip=0.0)
    trainer.micro_batch(hs, ids, loss_mask, seq_lens, anchors=anchors)
    local = trainer.local_weight_total
    own = trainer.apply_step().grad_norm
    other = make_trainer(tiny_target, grad_clip=0.0)
    other.micro_batch(hs, ids, loss_mask, seq_lens, anchors=anchors)
    halved = other.apply_step(total_weight=2 * local).grad_norm
    assert math.isclose(halved, own / 2, rel_tol=1e-5)


def test_drop_step_discards_the_gradients(tiny_target, tiny_target_model):
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=2, seq_len=16, seed=9)
    trainer = make_trainer(tiny_target)
    before = _params(trainer)
    trainer.micro_batch(hs, ids, loss_mask, seq_lens)
    trainer.drop_step()
    assert trainer.step == 0 and trainer.local_weight_total == 0
    assert all(p.grad is None for p in trainer.params)
    assert all(torch.equal(p, before[n]) for n, p in _params(trainer).items())


def test_state_round_trip_continues_identically(tiny_target, tiny_target_model, tmp_path):
    batches = [random_batch(tiny_target_model, batch=2, seq_len=20, seed=s) for s in range(3)]

    def run(trainer, num_steps):
        losses = []
        for i in range(num_steps):
            for batch in batches[i % 2:i % 2 + 2]:  # two micro-batches, anchors drawn by the trainer
                trainer.micro_batch(*batch)
            losses.append(trainer.apply_step().loss)
        return losses

    trainer = make_trainer(tiny_target, seed=3, total_steps=10)
    run(trainer, 3)
    save_state(trainer.state_dict(), tmp_path / "state")
    expected = run(trainer, 3)

    resumed = make_trainer(tiny_target, seed=99, total_steps=10)  # different seed: everything comes from the state
    resumed.load_state_dict(load_state(tmp_path / "state"))
    assert resumed.step == 3
    assert run(resumed, 3) == expected
    assert resumed.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
    for name, p in _params(resumed).items():
        assert torch.equal(p, _params(trainer)[name])


def test_the_state_dict_holds_the_live_weights_not_device_clones(tiny_target):
    """A checkpoint copies the weights to the host once (common/dataplane/host_staging.py); a clone on the
    device first would take the weights' size again in GPU memory."""
    trainer = make_trainer(tiny_target, seed=3, total_steps=10)
    state = trainer.state_dict()["model"]
    for name, p in trainer.model.draft_named_parameters():
        assert state[name].data_ptr() == p.data_ptr(), name


def test_warmup_then_cosine():
    factor = warmup_cosine(100, 0.04, 0.0)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(factor(4 + 48), 0.5, rel_tol=1e-9)
    assert factor(100) == 0.0


def test_overfit_one_fixed_batch(tiny_target, tiny_target_model):
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=2, seq_len=24, seed=11)
    trainer = make_trainer(tiny_target, lr=3e-3, total_steps=40, num_draft_layers=2)
    losses, accuracy = [], []
    for _ in range(40):
        trainer.micro_batch(hs, ids, loss_mask, seq_lens)
        stats = trainer.apply_step()
        losses.append(stats.loss)
        accuracy.append(stats.accuracy[0])
    print("overfit loss", " ".join(f"{x:.3f}" for x in losses[::4]), "acc@1", accuracy[-1])
    assert sum(losses[-5:]) / 5 < 0.4 * sum(losses[:5]) / 5
    assert accuracy[-1] > 0.9


def test_bfloat16_autocast_step_is_close_to_float32(tiny_target, tiny_target_model):
    batch = random_batch(tiny_target_model, batch=2, seq_len=20, seed=12)
    anchors = torch.tensor([[4, 9, 13], [5, 8, PAD_ANCHOR]])
    losses = []
    for dtype in ("float32", "bfloat16"):
        trainer = make_trainer(tiny_target, dtype=dtype)
        losses.append(trainer.micro_batch(*batch, anchors=anchors).loss)
        assert math.isfinite(trainer.apply_step().grad_norm)
    assert math.isclose(losses[0], losses[1], rel_tol=2e-2)


def test_slot_dtypes_and_an_empty_padding_row(tiny_target, tiny_target_model):
    # A slot holds int32 ids, a uint8 loss mask, int32 lengths, bfloat16 states, and rows beyond the
    # batch's real sequences have length 0.
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=3, seq_len=16, seed=13)
    seq_lens[2] = 0
    loss_mask[2] = False
    trainer = make_trainer(tiny_target)
    stats = trainer.micro_batch(hs.to(torch.bfloat16), ids.to(torch.int32), loss_mask.to(torch.uint8),
                                seq_lens.to(torch.int32))
    assert stats.num_tokens == 16 + 13 and stats.num_blocks > 0 and math.isfinite(stats.loss)


def test_micro_batch_equals_the_dense_reference(tiny_target, tiny_target_model):
    """Loss, weight, accuracy counts and gradients of a micro-batch equal those of the straightforward
    computation: one dense masked SDPA over every key, and the plain CE over the supervised positions
    picked by a mask (what the trainer did before it kept its shapes fixed and its figures on the device)."""
    hs, ids, loss_mask, seq_lens = random_batch(tiny_target_model, batch=3, seq_len=24, seed=14)
    anchors = torch.tensor([[4, 10, 17, 21], [6, 7, 19, PAD_ANCHOR], [5, 9, 14, PAD_ANCHOR]])  # 19, 21: near the end
    trainer = make_trainer(tiny_target, loss_chunk_size=5, num_draft_layers=2)
    stats = trainer.micro_batch(hs, ids, loss_mask, seq_lens, anchors=anchors)
    grads = {n: p.grad.clone() for n, p in trainer.model.draft_named_parameters()}
    trainer.drop_step()

    model = trainer.model
    model.attention = "dense"
    labels = block_labels(ids, loss_mask, seq_lens, anchors, 4)
    supervised = labels != IGNORE
    block_pos = torch.arange(4).expand_as(labels)[supervised]
    hidden = model(hs, ids, anchors)
    expected = weighted_ce(model.logits(hidden[supervised]), labels[supervised], block_pos, trainer.weights_K)
    expected.weighted_sum.backward()
    assert 0 < int(stats.num_positions) < labels[:, :, 1:].numel()  # some positions are not supervised
    assert math.isclose(stats.loss, expected.loss, rel_tol=1e-6)
    assert math.isclose(float(stats.weight), float(expected.weight_total), rel_tol=1e-12)
    assert torch.equal(stats.correct_K, expected.correct_K) and torch.equal(stats.count_K, expected.count_K)
    for name, p in model.draft_named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
