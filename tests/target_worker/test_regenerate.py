"""hsd regenerate: every assistant turn becomes the target's greedy answer given the regenerated
history, batched with left padding, identical to model.generate on each turn alone."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 model and the tiny tokenizer, saved like any Hugging Face model."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    out = save_tiny_tokenizer(tmp_path_factory.mktemp("model"))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
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
