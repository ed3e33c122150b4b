"""``hsd bench target --tp-sizes``: tokens/s per GPU of one target at tp_size 1 and 2 (gloo on the CPU
here), and ``hsd bench gpu``'s ``tp_target`` section, which says why it skips below two GPUs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_sections import TINY, CheckContext, Skip, tp_target
from benchmarks.tp_target import bench_tp_target, format_tp_bench
from common.run.config import load_config
from tiny_target import save_tiny_model


def test_tp_sizes_are_timed_on_the_same_jobs_per_gpu(tmp_path):
    model_dir = save_tiny_model("qwen3", tmp_path / "qwen3", num_layers=4)
    config = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.model={model_dir}",
                                "target.capture_layers=[0, 1, 2]", "schedule.buckets=[32, 64]",
                                "schedule.tokens_per_batch=128"])
    result = bench_tp_target(config, [1, 2], warmup=1, reps=2, seed=0, num_samples=40, median=30.0, sigma=0.5)
    one, two = result["sizes"]
    assert (one["tp_size"], two["tp_size"]) == (1, 2)
    assert one["jobs"] == two["jobs"] and one["tokens"] == two["tokens"] > 0  # the same jobs
    assert two["tok_s_per_gpu"] == pytest.approx(two["tok_s"] / 2)
    assert "tok/s per GPU" in format_tp_bench(result)


def test_the_gpu_section_says_why_it_skips_below_two_gpus(tmp_path):
    ctx = CheckContext(device=torch.device("cpu"), tmp=tmp_path, shapes=TINY)
    with pytest.raises(Skip, match="a tp_size 2 target group needs two GPUs, this host has 0"):
        tp_target(ctx)
