"""The EAGLE-3 backend and its export: a checkpoint resumes the run exactly, the exported directory
has the layout serving engines load, and ``hsd eval``'s speculative decoding with it equals greedy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from common.run.capture_contract import contract_from_config
from common.dataplane.slots import SlotBatch, SlotHeader
from common.run.witness import latest_checkpoint, servable_dir
from drafter_worker.eagle3.export import load_drafter
from drafter_worker.eagle3_backend import Eagle3Backend
from drafter_worker.factory import trainer_backend
from drafter_worker.speculative_eval import evaluate
from eagle3_testing import DRAFT_VOCAB, LAYER_IDS, backend_config, random_batch, random_prepared
from worker_jobs import held_job

HIDDEN = 64  # the tiny target's


def _jobs(target_model, count: int):
    out = []
    for job_id in range(count):
        hs, ids, mask, lens = random_batch(target_model, batch=2, seq_len=20, seed=100 + job_id)
        header = SlotHeader(generation=1, job_id=job_id, bucket=0, batch_size=2, seq_len=20, num_tokens=int(lens.sum()))
        out.append((held_job(job_id), SlotBatch(hs, ids.to(torch.int32), mask.to(torch.uint8), lens.to(torch.int32),
                                                header)))
    return out


def _train(backend, jobs, steps: range) -> list[float]:
    losses = []
    for step in steps:
        window = jobs[2 * step:2 * step + 2]
        for job, batch in window:
            backend.micro_batch(job, batch)
        losses.append(backend.apply_step([job.job_id for job, _ in window])["loss"])
    return losses


def test_checkpoint_resumes_exactly_and_exports_the_eagle3_layout(tiny_target, tiny_target_model, tmp_path):
    config = backend_config(tiny_target, tmp_path / "run", random_prepared(tmp_path / "data"))
    contract = contract_from_config(config)
    jobs = _jobs(tiny_target_model, 8)
    straight = trainer_backend(config, "drafter-0", backend_class=Eagle3Backend, schedule_jobs=8)
    assert straight.contract == contract and contract.final_norm and contract.row_width == 4 * HIDDEN
    reference = _train(straight, jobs, range(4))
    assert reference[-1] < reference[0]

    first = trainer_backend(config, "drafter-0", backend_class=Eagle3Backend, schedule_jobs=8)
    assert first.load_latest(config.run_dir) == 0
    assert _train(first, jobs, range(2)) == reference[:2]
    first.save_checkpoint(config.run_dir)
    resumed = trainer_backend(config, "drafter-0", backend_class=Eagle3Backend, schedule_jobs=8)
    assert resumed.load_latest(config.run_dir) == 2
    assert _train(resumed, jobs, range(2, 4)) == reference[2:]
    for name, tensor in straight.trainer.model.draft_state_dict().items():
        assert torch.equal(tensor, resumed.trainer.model.draft_state_dict()[name]), name

    exported = servable_dir(latest_checkpoint(config.run_dir, "drafter-0"))
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    doc = json.loads((exported / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLMEagle3"] and doc["num_hidden_layers"] == 1
    assert (doc["draft_vocab_size"], doc["vocab_size"]) == (DRAFT_VOCAB, 300)
    assert doc["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS]  # vLLM: hidden_states indices
    assert "target_hidden_size" not in doc  # the drafter's hidden size is the target's
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert shapes["fc.weight"] == (HIDDEN, 3 * HIDDEN)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 16, 2 * HIDDEN)
    assert shapes["lm_head.weight"] == (DRAFT_VOCAB, HIDDEN)
    assert not any("embed" in name for name in shapes)
    assert {n for n in shapes if not n.startswith("midlayer.")} == {"fc.weight", "norm.weight", "lm_head.weight",
                                                                    "d2t", "t2d"}
    assert (d2t.dtype, d2t.shape, t2d.dtype, t2d.shape) == (torch.int64, (DRAFT_VOCAB,), torch.bool, (300,))
    assert torch.equal(d2t, straight.trainer.model.d2t)

    model = load_drafter(exported, tiny_target)  # the checkpoint of step 2: first's weights
    for name, tensor in first.trainer.model.draft_state_dict().items():
        torch.testing.assert_close(model.draft_state_dict()[name], tensor.to(model.draft_state_dict()[name].dtype))
    prompts = [jobs[0][1].input_ids[0, :6].long().tolist(), jobs[1][1].input_ids[1, :5].long().tolist()]
    result = evaluate(tiny_target, str(exported), prompts, 10, target=tiny_target_model)  # raises unless == greedy
    assert result["block_size"] == 3 + 1 and len(result["per_position"]) == 3
    # the export drafts what the trained model drafts: the same verify steps, accepted alike
    assert result == evaluate(tiny_target, first.trainer.model, prompts, 10, target=tiny_target_model)
    assert result["tau"] == pytest.approx(1 + sum(result["per_position"]), abs=1e-12)


def test_an_optimizer_step_reads_the_host_once(tiny_target, tiny_target_model, tmp_path):
    """Two micro-batches and the step, as the drafter loop calls them: the only read is the step's
    figures at its end, as for DFlash (tests/drafter_worker/test_dflash_backend.py). On a GPU every
    read waits for the queued work: one per TTT step and micro-batch would keep the next slot's copy
    from overlapping compute."""
    import math

    from host_reads import HostReads
    config = backend_config(tiny_target, tmp_path / "run", random_prepared(tmp_path / "data"), "eagle3.log_every=1")
    backend = trainer_backend(config, "drafter-0", backend_class=Eagle3Backend, schedule_jobs=8)
    jobs = _jobs(tiny_target_model, 2)
    with HostReads() as reads:
        for job, batch in jobs:
            backend.micro_batch(job, batch)
        metrics = backend.apply_step([0, 1])
    assert reads.names == ["tolist"], reads.names
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
