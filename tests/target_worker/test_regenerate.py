"""hsd regenerate: every assistant turn becomes the target's greedy answer given the regenerated
history, batched with left padding, identical to model.generate on each turn alone; a reasoning
target's multi-turn conversations keep its reasoning where hsd prepare reads it, and prepare whole."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from chat_templates import QWEN3_STYLE, save_templated_tokenizer
from tiny_tokenizers import save_tiny_tokenizer

from common.run.config import load_config
from target_worker.chat_rows import row_messages
from target_worker.regenerate import regenerate_file

MAX_NEW_TOKENS = 8
ROWS = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "You are a helpful assistant."},
        {"from": "human", "value": "Repeat these words: red cat dog bird fish."},
        {"from": "gpt", "value": "old answer"},
        {"from": "human", "value": "Now say them in reverse."},
        {"from": "gpt", "value": "old answer"}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is 2 plus 3?"},
                             {"role": "assistant", "content": "old"}]},
    {"id": "c", "conversations": [
        {"from": "human", "value": "Count from 3 to 9."}, {"from": "gpt", "value": "old"},
        {"from": "human", "value": "How many were there, and which came first and last?"},
        {"from": "gpt", "value": "old"},
        {"from": "human", "value": "Say the first three again."}, {"from": "gpt", "value": "old"}]},
]


def tiny_qwen3(tokenizer):
    """A tiny random Qwen3 over ``tokenizer``'s vocabulary (seeded), ending its answers at its eos."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 model and the tiny tokenizer, saved like any Hugging Face model."""
    from transformers import AutoTokenizer
    out = save_tiny_tokenizer(tmp_path_factory.mktemp("model"))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = tiny_qwen3(tokenizer)
    model.save_pretrained(str(out))
    return out


def test_greedy_regeneration_matches_generate_turn_by_turn(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS) + "{broken\n")
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump({"target": {"model": str(model_dir), "num_capture_layers": 1}}))
    out = tmp_path / "out.jsonl"
    counts = regenerate_file(load_config(config_path), source, out, max_new_tokens=MAX_NEW_TOKENS, batch_size=3)
    assert counts == {"rows": 4, "written": 3, "skipped": 1}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["a", "b", "c"]
    assert "conversations" in rows[0] and "messages" in rows[1]

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    num_checked = 0
    for before, after in zip(ROWS, rows):
        old, new = row_messages(before), row_messages(after)
        assert [m["role"] for m in old] == [m["role"] for m in new]
        for i, message in enumerate(new):
            if message["role"] != "assistant":
                assert message == old[i]
                continue
            # The regenerated history (new[:i]) is the prompt, as a user of the dataset sees it.
            text = tokenizer.apply_chat_template(new[:i], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=MAX_NEW_TOKENS)[0, ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in generated:
                generated = generated[:generated.index(tokenizer.eos_token_id)]
            assert message["content"] == tokenizer.decode(generated, skip_special_tokens=True)
            assert message["content"] != old[i]["content"]
            num_checked += 1
    assert num_checked == 6


def test_cli_requires_the_target_model(tmp_path):
    from hsd_testing import hsd
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(ROWS[1]) + "\n")
    proc = hsd("regenerate", "--config", str(tmp_path / "none.yaml"), "--input", str(source), "--out",
               str(tmp_path / "o.jsonl"), check=False)
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    (tmp_path / "c.yaml").write_text("target: {count: 1}\n")
    proc = hsd("regenerate", "--config", str(tmp_path / "c.yaml"), "--input", str(source), "--out",
               str(tmp_path / "o.jsonl"), check=False)
    assert proc.returncode != 0 and "target.model" in proc.stderr


REASONING_ROWS = [
    {"id": "r1", "system": "Think before answering.", "conversations": [
        {"from": "human", "value": "Add 3 and 4."}, {"from": "gpt", "value": "old"},
        {"from": "human", "value": "Now double it."}, {"from": "gpt", "value": "old"}]},
    {"id": "r2", "messages": [
        {"role": "user", "content": "What is 4 times 6?"},
        {"role": "assistant", "content": None, "reasoning_content": "old reasoning", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 4, "b": 6}}}]},
        {"role": "tool", "content": "24"},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "old"}]},
]


@pytest.fixture(scope="module")
def reasoning_model_dir(tmp_path_factory):
    """A tiny random Qwen3 with a Qwen3-style template whose greedy output is made a reasoning
    block then an answer, ``<think>7</think>9``, by bigram biases in its generation config (each
    token of that output follows the one before it, the first follows the generation prompt's
    newline)."""
    from transformers import AutoTokenizer
    out = save_templated_tokenizer(tmp_path_factory.mktemp("reasoning_model"), QWEN3_STYLE)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    chain = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("\n", "<think>", "7", "</think>", "9")]
    assert all(len(ids) == 1 for ids in chain)
    chain = [ids[0] for ids in chain] + [tokenizer.eos_token_id]
    model = tiny_qwen3(tokenizer)
    model.generation_config.sequence_bias = [[[a, b], 100.0] for a, b in zip(chain, chain[1:])]
    model.save_pretrained(str(out))
    return out


def test_reasoning_target_multi_turn_regenerated_then_prepared_skips_nothing(tmp_path, reasoning_model_dir):
    from transformers import AutoTokenizer

    from common.run.prepared import PreparedDataset
    from target_worker.prepare import prepare_dataset
    from target_worker.regenerate import reasoning_opening
    torch.set_num_threads(1)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in REASONING_ROWS))
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump({"target": {"model": str(reasoning_model_dir), "num_capture_layers": 1}}))
    out = tmp_path / "out.jsonl"
    assert regenerate_file(load_config(config_path), source, out, max_new_tokens=8, batch_size=2)["written"] == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # The target's whole output is the turn's content; the old reasoning and tool calls are gone.
    assert [m for m in row_messages(rows[1]) if m["role"] == "assistant"] == \
        [{"role": "assistant", "content": "<think>7</think>9"}] * 3
    assert rows[0]["system"] == "Think before answering."
    assert rows[1]["messages"][2] == {"role": "tool", "content": "24"}

    prepare_dataset(out, reasoning_model_dir, tmp_path / "data", progress=False)
    dataset = PreparedDataset(tmp_path / "data")
    assert dataset.manifest["rows"]["skipped"] == 0 and len(dataset) == 2
    tokenizer = AutoTokenizer.from_pretrained(str(reasoning_model_dir))
    for i, num_answers in ((0, 2), (1, 3)):
        ids, mask = dataset.sample(i)
        runs = np.split(ids[mask == 1], np.where(np.diff(np.flatnonzero(mask)) > 1)[0] + 1)
        # Earlier answers as the template renders them once a later user turn follows: reasoning dropped.
        assert [tokenizer.decode(run) for run in runs] == \
            ["9<|im_end|>"] * (num_answers - 1) + ["<think>\n7\n</think>\n\n9<|im_end|>"]

    # A generation prompt that opens the reasoning itself (DeepSeek-R1's): the opening is kept in the content.
    opened = save_templated_tokenizer(tmp_path / "opened", QWEN3_STYLE.replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"))
    assert reasoning_opening(AutoTokenizer.from_pretrained(str(opened))) == "<think>\n"
    assert reasoning_opening(tokenizer) == ""
