"""``hsd capture`` and ``hsd bench target`` on a tiny Qwen3 target, against a real shared-memory slot."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from common.run.config import load_config
from common.dataplane.shm_arena import SlotArena
from common.dataplane.slots import SlotLayout, copy_out
from hsd import cli
from target_worker import offline
from target_worker.hf_backend import HFTargetBackend
from tiny_target import NpzSamples, random_samples, save_tiny_model

torch.set_num_threads(1)
LENGTHS = [12, 40, 64, 5, 16, 70, 33, 9, 20]  # 70 exceeds the last bucket (64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    model_dir = save_tiny_model("qwen3", root / "model")
    data_dir = NpzSamples.write(root / "data", random_samples(LENGTHS, seed=5))
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "run": {"dir": str(root / "run")},
        "schedule": {"buckets": [16, 32, 64], "tokens_per_batch": 128},
        "pool": {"slots": 2, "min_ready": 1},
        "target": {"model": str(model_dir), "num_capture_layers": 3}}))
    return root, config_path, data_dir


def test_capture_file_matches_what_extract_writes_into_a_shm_slot(setup, monkeypatch, capsys):
    root, config_path, data_dir = setup
    monkeypatch.setattr(offline, "open_dataset", NpzSamples.open)
    out = root / "hs.safetensors"
    assert cli.main(["capture", "--config", str(config_path), "--data", str(data_dir), "--samples", "8",
                     "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "captured 7 samples" in printed and "1 longer than the last bucket skipped" in printed

    tensors = load_file(str(out))
    captured = [i for i in range(8) if i != 5]
    assert sorted(tensors) == sorted(f"sample.{i}.{name}" for i in captured
                                     for name in ("hidden", "input_ids", "loss_mask"))
    with safe_open(str(out), framework="pt") as f:
        contract = json.loads(f.metadata()["contract"])
        assert f.metadata()["dataset_fingerprint"] == "npz-test-set"
    assert contract["layer_ids"] == [1, 3, 5] and contract["dtype"] == "float32"

    # The worker's path: the same jobs extracted into a slot of a real shared-memory arena.
    config = load_config(config_path)
    dataset = NpzSamples.open(data_dir)
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device="cpu", dataset=dataset)
    layout = SlotLayout.from_config(config)
    assert layout == SlotLayout.from_contract(backend.contract, config.schedule)
    jobs, skipped = offline.plan_jobs(LENGTHS[:8], buckets=[16, 32, 64], tokens_per_batch=128)
    assert skipped == [5] and sorted(i for job in jobs for i in job.samples) == captured
    arena = SlotArena.create("capturetest", layout, 1)
    try:
        for job in jobs:
            backend.extract(job, arena.slot(0))
            batch = copy_out(arena.slot(0), job.generation, torch.device("cpu"))
            for row, index in enumerate(job.samples):
                n = LENGTHS[index]
                ids, mask = dataset.sample(index)
                assert tensors[f"sample.{index}.hidden"].shape == (n, 3 * 32)
                assert torch.equal(tensors[f"sample.{index}.hidden"], batch.hs[row, :n])
                assert tensors[f"sample.{index}.input_ids"].tolist() == ids.tolist() == batch.input_ids[row, :n].tolist()
                assert tensors[f"sample.{index}.loss_mask"].tolist() == mask.tolist()
    finally:
        arena.close()
        arena.unlink()
        backend.close()
    assert not os.path.exists(arena.path)


def test_capture_errors_are_clear(setup, monkeypatch, capsys):
    root, config_path, data_dir = setup
    monkeypatch.setattr(offline, "open_dataset", NpzSamples.open)
    args = ["capture", "--config", str(config_path), "--data", str(data_dir), "--out", str(root / "x.safetensors")]
    assert cli.main(args + ["--samples", "50"]) == 2
    assert "holds 9 samples, fewer than the 50 asked for" in capsys.readouterr().err
    assert cli.main(args + ["--samples", "2", "target.model="]) == 2
    assert "needs target.model" in capsys.readouterr().err


def test_bench_target_json(setup, capsys):
    _root, config_path, _data_dir = setup
    assert cli.main(["bench", "target", "--config", str(config_path), "--json", "--warmup", "0", "--reps", "1",
                     "--samples", "400", "--median", "20", "--sigma", "0.7"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batching"] == "sorted" and set(result["batchings"]) == {"sorted", "fixed"}
    assert result["lengths"]["max_len"] == 64 and set(result["buckets"]) == {"16", "32", "64"}
    for batching, figures in result["batchings"].items():
        assert 0 < figures["fill"] <= 1 and figures["capture_tok_s"] > 0
        jobs = sum(row["jobs"] for row in figures["buckets"].values())
        assert jobs == figures["num_jobs"]
        # The overall fill is the per-bucket fills weighted by their jobs (every job offers 128 slot tokens).
        weighted = sum(row["fill"] * row["jobs"] for row in figures["buckets"].values()) / jobs
        assert figures["fill"] == pytest.approx(weighted)
        for seq_len, row in figures["buckets"].items():
            assert 0 < row["fill"] <= 1 and row["capture_tok_s"] > 0
            assert all(rows * length <= 128 and length <= int(seq_len) for rows, length in row["shapes"])
    assert result["batchings"]["sorted"]["fill"] > result["batchings"]["fixed"]["fill"]
    for row in result["buckets"].values():
        assert row["plain_tok_s"] > 0 and row["speedup"] > 0
    assert result["contract"]["layer_ids"] == [1, 3, 5] and isinstance(result["capture_not_slower"], bool)
