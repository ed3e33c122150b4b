"""A real Hugging Face target (a tiny Qwen3 built by make-tiny on a tiny budget) behind the dispatcher:
the capture contract comes from the model, a dataset prepared with another tokenizer is refused, and
an epoch of the prepared data is committed exactly once with every slot checked against the dataset."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from common.run.capture_contract import contract_from_model_dir
from hsd_testing import hsd, report

SPEC = dict(num_train=120, num_heldout=4, steps=3, warmup_steps=1, hidden_size=32, intermediate_size=64,
            num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16)
BUILD = f"""
import sys
from target_worker.tiny import TinySpec, make_tiny
make_tiny(sys.argv[1], seed=int(sys.argv[2]), spec=TinySpec(**{SPEC!r}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and its conversations, prepared with its own tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    model = root / "model"
    subprocess.run([sys.executable, "-c", BUILD, str(model), "1"], check=True, timeout=240, capture_output=True)
    data = root / "data"
    hsd("prepare", "--input", str(model / "conversations.jsonl"), "--tokenizer", str(model), "--out", str(data),
        "--max-length", "256")
    return model, data


def real_args(run_dir, model, data, *extra):
    return [f"run.dir={run_dir}", "target.sim=false", f"target.model={model}", f"data.path={data}",
            "drafter.sim=true", "schedule.buckets=[64,128,256]", "target.capture_layers=[1,2]", "schedule.tokens_per_batch=512",
            "pool.slots=6", "pool.min_ready=2", "dispatcher.heartbeat_s=0.2", "dispatcher.worker_timeout_s=10",
            "run.epochs=1", *extra]


def test_real_target_and_sim_drafters_commit_an_epoch_exactly_once(tiny, run_dir):
    model, data = tiny
    proc = hsd("launch", *real_args(run_dir, model, data, "target.count=1", "drafter.count=2"), timeout=300)
    assert "run complete: every epoch committed" in proc.stderr
    r = report(run_dir)
    assert (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
    assert (r["witness_duplicates"], r["witness_missing"]) == (0, 0)
    assert r["slots_verified"] == r["jobs_total"]          # every slot checked against the prepared dataset
    assert "SlotIntegrityError" not in proc.stdout
    # the dispatcher took its capture contract from the model's config.json, and the target agreed
    contract = contract_from_model_dir(model, layer_ids=[1, 2], dtype="float32").to_dict()
    logged = re.findall(r"capture contract of this run \(from the target model's config.json\): (\{.*\})", proc.stdout)
    assert [ast.literal_eval(line) for line in logged] == [contract]


def test_a_dataset_prepared_with_another_tokenizer_is_refused(tiny, tmp_path, run_dir):
    model, data = tiny
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-c", BUILD, str(other), "2"], check=True, timeout=240, capture_output=True)
    proc = hsd("target", *real_args(run_dir, other, data), "--name", "t", check=False, timeout=120)
    assert proc.returncode == 2
    assert "another tokenizer" in proc.stderr and str(other) in proc.stderr
