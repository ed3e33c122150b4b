"""make-tiny on a tiny budget (the real recipe is run by hand: it takes minutes): the directory loads
with AutoModelForCausalLM/AutoTokenizer, the build is a function of the seed, a finished directory
is reused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from target_worker.tiny import MARKER_FILE, REPORT_FILE, TinySpec, make_tiny

SPEC = dict(num_train=200, num_heldout=4, steps=3, warmup_steps=1, hidden_size=32, intermediate_size=64,
            num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
# Built in a child process: make_tiny pins torch's thread count and deterministic mode for its process.
BUILD = f"""
import sys
from target_worker.tiny import TinySpec, make_tiny
for out in sys.argv[1:]:
    make_tiny(out, seed=5, spec=TinySpec(**{SPEC!r}))
"""


def build(*dirs) -> None:
    subprocess.run([sys.executable, "-c", BUILD, *map(str, dirs)], check=True, timeout=240, capture_output=True)


def test_tiny_target_loads_is_deterministic_and_is_reused(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    first, second = tmp_path / "first", tmp_path / "second"
    build(first, second)
    weights = "model.safetensors"
    assert (first / weights).read_bytes() == (second / weights).read_bytes()
    assert (first / "conversations.jsonl").read_bytes() == (second / "conversations.jsonl").read_bytes()
    report = json.loads((first / REPORT_FILE).read_text())
    assert {"match_rate_trained", "match_rate_untrained", "seconds", "heldout_turns"} <= set(report)
    assert (first / MARKER_FILE).is_file()
    assert len((first / "heldout.jsonl").read_text().splitlines()) == 4
    assert len((first / "conversations.jsonl").read_text().splitlines()) == 200

    model = AutoModelForCausalLM.from_pretrained(str(first))
    tokenizer = AutoTokenizer.from_pretrained(str(first))
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Spell the word cat."}], tokenize=False,
                                           add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)

    stamp = (first / weights).stat().st_mtime_ns
    assert make_tiny(first, seed=5, spec=TinySpec(**SPEC)) == report  # finished: reused, nothing rewritten
    assert (first / weights).stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="seed 5"):
        make_tiny(first, seed=6, spec=TinySpec(**SPEC))
