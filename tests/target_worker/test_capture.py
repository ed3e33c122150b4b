"""The capture forward against a plain Hugging Face forward, on tiny Qwen3 and Llama targets."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from common.run.capture_contract import contract_from_model_dir
from common.run.config import ConfigError
from common.dataplane.slots import SlotLayout, SlotView, copy_out
from common.wire import messages
from target_worker.capture import LayerCapture, contract_shape_of, load_target_model
from target_worker.hf_backend import HFTargetBackend
from tiny_target import random_samples, save_tiny_model, tiny_config
from worker_jobs import held_job

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request, tmp_path_factory):
    return save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _raw_outputs(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], object]:
    """Every decoder layer's own output in a plain Hugging Face forward (forward hooks on the layers:
    the residual stream before any final norm, what vLLM and SGLang feed a drafter), and the forward's
    output with ``output_hidden_states``."""
    outputs: dict[int, torch.Tensor] = {}

    def keep(index):
        def hook(_module, _args, output):
            outputs[index] = (output[0] if isinstance(output, tuple) else output).clone()
        return hook
    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            out = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [outputs[i] for i in range(len(model.model.layers))], out


def _plain_layers(model, ids: torch.Tensor, mask: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    raw, _ = _raw_outputs(model, ids, mask)
    return torch.cat([raw[i] for i in layer_ids], dim=-1)


def test_last_layer_is_captured_before_the_final_norm(model_dir):
    """Layer N-1's block is that layer's raw output, not hidden_states[N] (the final norm's output),
    which a plain forward reports in its place: the engines never feed a drafter the normed state."""
    model = load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)
    torch.manual_seed(5)
    ids = torch.randint(1, 97, (2, 16))
    mask = torch.ones_like(ids)
    raw, out = _raw_outputs(model, ids, mask)
    capture = LayerCapture(model, [2, 7], max_tokens=32)
    hidden = model.config.hidden_size
    last = capture(ids, mask)[..., hidden:].clone()
    capture.close()
    torch.testing.assert_close(last, raw[7], atol=1e-5, rtol=0)
    assert (last - out.hidden_states[8]).abs().max() > 0.1  # the normed state differs from it
    torch.testing.assert_close(out.hidden_states[8], model.model.norm(raw[7]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layer_ids", [[1, 3, 5], [0, 6, 7]])  # the DFlash default for 8 layers; first and last
def test_capture_equals_the_raw_layer_outputs(model_dir, layer_ids):
    model = load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (3, 32))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    mask[2, 5:] = 0
    expected = _plain_layers(model, ids, mask, layer_ids)
    hooks_before = [len(layer._forward_hooks) for layer in model.model.layers]
    capture = LayerCapture(model, layer_ids, max_tokens=96)
    captured = capture(ids, mask).clone()
    for row, length in enumerate((32, 20, 5)):
        torch.testing.assert_close(captured[row, :length], expected[row, :length], atol=1e-5, rtol=0)
    # The full model is untouched: same layers, and its forward still gives the same states.
    assert len(model.model.layers) == 8
    torch.testing.assert_close(_plain_layers(model, ids, mask, layer_ids), expected, atol=0, rtol=0)
    capture.close()
    assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks_before


def test_final_norm_capture_adds_the_last_hidden_state_after_the_norm(model_dir):
    """The EAGLE-3 contract: the layers, then hidden_states[-1] (the final norm's output) as one more
    block, also when the last layer is one of the captured ones (its block stays the raw output)."""
    layer_ids = [0, 6, 7]
    model = load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)
    torch.manual_seed(3)
    ids = torch.randint(1, 97, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    raw, out = _raw_outputs(model, ids, mask)
    expected = torch.cat([raw[i] for i in layer_ids] + [out.hidden_states[-1]], dim=-1)
    capture = LayerCapture(model, layer_ids, max_tokens=32, final_norm=True)
    assert capture.row_width == 4 * model.config.hidden_size and capture.last_layer == 7
    captured = capture(ids, mask).clone()
    for row, length in enumerate((16, 9)):
        torch.testing.assert_close(captured[row, :length], expected[row, :length], atol=1e-5, rtol=0)
    capture.close()


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_capture_finds_other_decoder_only_architectures(kind, tmp_path):
    model_dir = save_tiny_model(kind, tmp_path / kind)
    model = load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)
    torch.manual_seed(2)
    ids = torch.randint(1, 97, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    capture = LayerCapture(model, [1, 3, 5], max_tokens=48)
    captured = capture(ids, mask).clone()
    expected = _plain_layers(model, ids, mask, [1, 3, 5])
    torch.testing.assert_close(captured[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(captured[1, :13], expected[1, :13], atol=1e-5, rtol=0)
    capture.close()


def test_default_attention_on_an_architecture_without_sdpa(tmp_path, caplog):
    """Gemma 2 declares no SDPA kernel: auto picks eager on the CPU, and the captured states equal the plain forward."""
    model_dir = save_tiny_model("gemma2", tmp_path / "gemma2")
    config = tiny_config(tmp_path, model_dir)
    assert config.target.attn_implementation == "auto"
    lengths = [29, 40, 17]  # a batch padded to its longest, 3 × 40 of the 128 tokens
    dataset = random_samples(lengths, seed=4)
    with caplog.at_level(logging.INFO, logger="hsd.target"):
        backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                                  device="cpu", dataset=dataset, keep_full_model=True)
    assert "Gemma2ForCausalLM: attention eager (auto, of eager, flash_attention_3, flash_attention_2, flex_attention)" \
        in caplog.text
    assert backend.model.config._attn_implementation == "eager"
    slot = _slot(backend, config)
    assert backend.extract(_job(0, [0, 1, 2], lengths, 40, 2), slot) is None  # complete on return on the CPU
    batch = copy_out(slot, 1, CPU)
    for row, n in enumerate(lengths):
        ids = torch.from_numpy(dataset.sample(row)[0].astype(np.int64))[None]
        alone = _plain_layers(backend.model, ids, torch.ones_like(ids), list(backend.contract.layer_ids))[0]
        torch.testing.assert_close(batch.hs[row, :n], alone, atol=1e-5, rtol=0)
    backend.close()
    # An explicit kernel the architecture lacks is a config error naming the key and what it supports.
    with pytest.raises(ConfigError, match=r"target.attn_implementation: Gemma2ForCausalLM does not support 'sdpa'.*"
                                          r"it supports eager, flash_attention_3, flash_attention_2, flex_attention"):
        load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)


def test_contract_from_config_json_matches_loaded_model(model_dir):
    contract = contract_from_model_dir(model_dir, num_capture_layers=3, dtype="float32")
    model = load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)
    assert contract_shape_of(model) == (contract.architecture, contract.num_layers, contract.hidden_size)
    assert contract.layer_ids == (1, 3, 5)
    assert all(not p.requires_grad for p in model.parameters()) and not model.training


def _slot(backend: HFTargetBackend, config) -> SlotView:
    layout = SlotLayout.from_contract(backend.contract, config.schedule)
    return SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8), layout)


def _job(job_id: int, samples: list[int], lengths: list[int], seq_len: int, bucket: int) -> messages.Job:
    return held_job(job_id, samples=samples, lengths=[lengths[i] for i in samples], seq_len=seq_len, bucket=bucket,
                    generation=job_id + 1)


def test_padding_to_bucket_shape_leaves_real_states_unchanged(model_dir, tmp_path):
    config = tiny_config(tmp_path, model_dir)  # buckets 16/32/64, 128 tokens per batch
    lengths = [33, 64, 40, 50]
    dataset = random_samples(lengths, seed=2)
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device="cpu", dataset=dataset, keep_full_model=True)
    slot = _slot(backend, config)
    layer_ids = list(backend.contract.layer_ids)

    # Sample 0 alone (padded to 64 and to the bucket's 2 rows) ...
    backend.extract(_job(0, [0], lengths, 64, 2), slot)
    alone = copy_out(slot, 1, CPU)
    # ... and second in a full batch next to a sequence that fills the whole row.
    backend.extract(_job(1, [1, 0], lengths, 64, 2), slot)
    together = copy_out(slot, 2, CPU)
    assert alone.hs.shape == (1, 64, 3 * 32) and together.hs.shape == (2, 64, 3 * 32)
    torch.testing.assert_close(together.hs[1, :33], alone.hs[0, :33], atol=1e-5, rtol=0)

    # Both equal the sequence run alone at its own length, with no padding at all.
    ids = torch.from_numpy(dataset.sample(0)[0].astype(np.int64))[None]
    unpadded = _plain_layers(backend.model, ids, torch.ones_like(ids), layer_ids)[0]
    torch.testing.assert_close(alone.hs[0, :33], unpadded, atol=1e-5, rtol=0)
    torch.testing.assert_close(together.hs[0], _plain_layers(
        backend.model, torch.from_numpy(dataset.sample(1)[0].astype(np.int64))[None],
        torch.ones(1, 64, dtype=torch.int64), layer_ids)[0], atol=1e-5, rtol=0)
    backend.close()


def test_extract_fills_the_slot_as_readers_expect(model_dir, tmp_path):
    config = tiny_config(tmp_path, model_dir)
    lengths = [10, 3, 16, 7, 12]
    dataset = random_samples(lengths, seed=3)
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device="cpu", dataset=dataset)
    slot = _slot(backend, config)
    job = _job(41, [4, 0, 2, 1, 3], lengths, 16, 0)  # 5 of the bucket's 8 rows
    backend.extract(job, slot)
    header = slot.expect_generation(42)
    assert (header.job_id, header.bucket, header.batch_size, header.seq_len, header.num_tokens) == (41, 0, 5, 16, 48)
    batch = copy_out(slot, 42, CPU)
    for row, index in enumerate(job.samples):
        ids, mask = dataset.sample(index)
        n = lengths[index]
        assert int(batch.seq_lens[row]) == n
        assert batch.input_ids[row, :n].tolist() == ids.tolist() and not batch.input_ids[row, n:].any()
        assert batch.loss_mask[row, :n].tolist() == mask.tolist() and not batch.loss_mask[row, n:].any()
        assert not batch.hs[row, n:].any() and batch.hs[row, :n].abs().sum(-1).min() > 0
    backend.close()

    # A worker frees the layers past the last captured one and the LM head; the slot is the same.
    assert len(backend.model.model.layers) == 6 and backend.model.lm_head is None
    full = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                           device="cpu", dataset=dataset, keep_full_model=True)
    assert len(full.model.model.layers) == 8
    again = _slot(full, config)
    full.extract(job, again)
    assert torch.equal(again.buffer, slot.buffer)
    full.close()


def test_eagle3_contract_puts_the_final_norm_state_in_the_slot(model_dir, tmp_path):
    """drafter.objective=eagle3: the default layers 1, N/2-1, N-4 and the final-norm state, 4 blocks a row."""
    config = tiny_config(tmp_path, model_dir, "drafter.objective=eagle3")
    lengths = [10, 16]
    dataset = random_samples(lengths, seed=4)
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device="cpu", dataset=dataset)
    assert (backend.contract.layer_ids, backend.contract.final_norm) == ((1, 3, 4), True)
    assert len(backend.model.model.layers) == 8  # the final norm needs every layer
    slot = _slot(backend, config)
    assert slot.layout.row_width == 4 * backend.capture.hidden_size
    backend.extract(_job(7, [0, 1], lengths, 16, 0), slot)
    batch = copy_out(slot, 8, CPU)
    full = load_target_model(model_dir, dtype=torch.float32, attn_implementation="sdpa", device=CPU)
    for row, n in enumerate(lengths):
        ids = torch.from_numpy(dataset.sample(row)[0].astype(np.int64)).unsqueeze(0)
        with torch.inference_mode():
            out = full(ids, output_hidden_states=True, use_cache=False)
        expected = torch.cat([out.hidden_states[i + 1] for i in (1, 3, 4)] + [out.hidden_states[-1]], dim=-1)
        torch.testing.assert_close(batch.hs[row, :n], expected[0], atol=1e-5, rtol=0)
    backend.close()


def test_extract_refuses_a_dataset_that_is_not_the_scheduled_one(model_dir, tmp_path):
    config = tiny_config(tmp_path, model_dir)
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device="cpu", dataset=random_samples([10, 20], seed=0))
    slot = _slot(backend, config)
    with pytest.raises(ValueError, match="sample 1 has 20 tokens .* schedule says 12"):
        backend.extract(held_job(0, bucket=1, seq_len=32, samples=[1], lengths=[12]), slot)
    assert slot.read_generation() == 0  # nothing published
    backend.close()
