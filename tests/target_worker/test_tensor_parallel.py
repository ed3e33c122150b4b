"""A tensor-parallel target group (tp_size 2, gloo on the CPU) writes the slots a single-process
target writes, and a target that cannot run as a group is refused before any process starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.dataplane.slots import SlotView, copy_out
from common.run.config import ConfigError, load_config, write_resolved
from common.run.tensor_parallel import check_tensor_parallel
from target_worker.hf_backend import HFTargetBackend
from tiny_target import random_samples, save_tiny_model, tiny_config
from tp_target_slots import extract_jobs

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [33, 64, 40, 9, 50, 17]
JOBS = ["1,0/64", "3,5,2/40"]  # mixed lengths, right-padded: 2 x 64 and 3 x 40 tokens
SEED = 4


def _slots_at_tp1(config, lengths) -> list[torch.Tensor]:
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective, device="cpu",
                              dataset=random_samples(lengths, seed=SEED))
    slots = extract_jobs(backend, config, lengths, JOBS)
    backend.close()
    return slots


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tp2_group_writes_the_slots_of_a_single_process_target(kind, tmp_path):
    model_dir = save_tiny_model(kind, tmp_path / kind, num_layers=4)
    config = tiny_config(tmp_path, model_dir, "target.capture_layers=[0, 1, 2]", "target.tp_size=2")
    config_path = write_resolved(config)
    out = tmp_path / "tp2.pt"
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_target_slots.py"), str(config_path), str(out),
                           str(SEED), ",".join(map(str, LENGTHS)), *JOBS], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sharded = torch.load(out)
    single = _slots_at_tp1(load_config(config_path, ["target.tp_size=1"]), LENGTHS)
    for job_id, (one, buffer) in enumerate(zip(single, sharded)):
        two = SlotView(buffer, one.layout)
        a, b = copy_out(one, job_id + 1, torch.device("cpu")), copy_out(two, job_id + 1, torch.device("cpu"))
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.seq_lens, b.seq_lens)
        hidden = one.layout.row_width // 3
        for k in range(3):  # every captured layer, on every real token
            x, y = a.hs[..., k * hidden:(k + 1) * hidden], b.hs[..., k * hidden:(k + 1) * hidden]
            assert x.abs().max() > 0
            relative = ((x - y).norm() / x.norm()).item()
            assert relative <= 1e-5, f"{kind} job {job_id} layer block {k}: relative difference {relative:.2e}"


def test_a_plan_that_cannot_capture_whole_states_is_refused_by_name(tmp_path):
    model_dir = save_tiny_model("qwen3", tmp_path / "qwen3", num_layers=2)
    assert "layers.*.mlp.down_proj" in check_tensor_parallel(model_dir, 2)
    with pytest.raises(ConfigError,
                       match=r"tp_size=4 does not divide Qwen3ForCausalLM's 2 num_key_value_heads.*\[1, 2\]"):
        check_tensor_parallel(model_dir, 4)  # 4 query heads, 2 KV heads
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_dir)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "norm": "sequence_parallel"}
    with pytest.raises(ConfigError, match=r"'norm' the style 'sequence_parallel'.*fragment.*tp_size: 1"):
        check_tensor_parallel(model_dir, 2, config=config)
    config.base_model_tp_plan = {}
    with pytest.raises(ConfigError, match=r"Qwen3ForCausalLM .* has no tensor-parallel plan in the installed "
                                          r"transformers .*set target.tp_size: 1"):
        check_tensor_parallel(model_dir, 2, config=config)


def test_gpus_not_a_multiple_of_tp_size_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"target.gpus lists 3 GPUs, not a multiple of target.tp_size=2"):
        load_config(None, [f"run.dir={tmp_path}", "target.tp_size=2", "target.gpus=[0, 1, 2]"])
    with pytest.raises(ConfigError, match=r"target.gpus lists 2 GPUs for target.count=2 groups of target.tp_size=2"):
        load_config(None, [f"run.dir={tmp_path}", "target.tp_size=2", "target.count=2", "target.gpus=[0, 1]"])


def test_hsd_launch_refuses_a_target_without_a_plan_before_any_process_starts(tmp_path, capsys):
    from transformers import OPTConfig, OPTForCausalLM

    from dflash_run import tiny_run_args
    from hsd.cli import main
    model_dir = tmp_path / "opt"
    OPTForCausalLM(OPTConfig(vocab_size=97, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                             word_embed_proj_dim=32, max_position_embeddings=128)).save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    args = tiny_run_args(tmp_path, run_dir, num_samples=4, extra=(f"target.model={model_dir}", "target.tp_size=2"))
    assert main(["launch", *args]) == 2
    assert re.search(r"target.tp_size=2: OPTForCausalLM \(.*config.json\) has no tensor-parallel plan in the "
                     r"installed transformers [\d.]+; set target.tp_size: 1", capsys.readouterr().err)
    assert not (run_dir / "logs").exists()  # no dispatcher, no worker


def test_the_shared_batch_and_the_rank_fault_parse_back():
    from common import faults
    from target_worker.tp_group import decode_batch, encode_batch
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    shared = decode_batch(encode_batch(41, ids, (ids != 0).long()))
    assert shared.job_id == 41 and torch.equal(shared.input_ids, ids)
    assert torch.equal(shared.attention_mask, (ids != 0).long())
    assert faults.parse("target_rank_fault=stop:1@2") == {"target_rank_fault": ("stop", 1, 2)}
    with pytest.raises(faults.FaultSpecError, match="<kill|stop>:<rank>@<job>"):
        faults.parse("target_rank_fault=term:1@2")


def test_hsd_launch_gives_each_group_its_gpus(tmp_path):
    from ops.launch import Launcher
    config = load_config(None, [f"run.dir={tmp_path}", "target.count=2", "target.tp_size=2", "target.gpus=[0, 1, 2, 3]",
                                "drafter.count=2", "drafter.gpus=[4, 5]"])
    children = Launcher(config)._plan(tmp_path / "config.yaml")
    assert [(c.name, c.env["CUDA_VISIBLE_DEVICES"]) for c in children] == [
        ("target-0", "0,1"), ("target-1", "2,3"), ("drafter-0", "4"), ("drafter-1", "5")]
