"""hsd prepare on data as users bring it: SpecForge's role/content turns, ShareGPT's top-level
system field, tool turns and tool calls, and reasoning targets' multi-turn conversations, under a
Qwen3-style template (which drops earlier reasoning) and a Llama-3.1-style one (which rewrites
nothing), in the default way and per turn. The witness is the text the masked tokens decode to,
written out by hand from what each template renders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat_templates import LLAMA31_STYLE, QWEN3_STYLE, save_templated_tokenizer
from hsd_testing import hsd
from tiny_tokenizers import save_tiny_tokenizer

from common.run.prepared import PreparedDataset
from target_worker.chat_rows import row_messages
from target_worker.prepare import prepare_dataset

SPECFORGE = {"id": "sf-1", "conversations": [{"role": "user", "content": "Add 2 and 3."},
                                             {"role": "assistant", "content": "2 + 3 = 5."},
                                             {"role": "user", "content": "And 4 and 4?"},
                                             {"role": "assistant", "content": "4 + 4 = 8."}]}
SHAREGPT_SYSTEM = {"system": "Answer in one line.", "conversations": [
    {"from": "human", "value": "Spell the word cat."}, {"from": "chatgpt", "value": "c - a - t."}]}
TOOLS = {"messages": [
    {"role": "user", "content": "What is 4 times 6?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 4, "b": 6}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "24"},
    {"role": "assistant", "content": [{"type": "text", "text": "4 times 6 is 24."}]}], "tools": ["ignored"]}

REASONING_IN_CONTENT = [{"role": "user", "content": "Add 2 and 3."},
                        {"role": "assistant", "content": "<think>\nTwo plus three.\n</think>\n\nIt is 5."},
                        {"role": "user", "content": "Now double it."},
                        {"role": "assistant", "content": "<think>\nFive times two.\n</think>\n\nIt is 10."}]
REASONING_APART = [{"role": "user", "content": "Add 2 and 3."},
                   {"role": "assistant", "content": "It is 5.", "reasoning_content": "Two plus three."},
                   {"role": "user", "content": "Now double it."},
                   {"role": "assistant", "content": "It is 10.", "reasoning_content": "Five times two."}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"chatml": save_tiny_tokenizer(root / "chatml"),
            "qwen3": save_templated_tokenizer(root / "qwen3", QWEN3_STYLE),
            "llama31": save_templated_tokenizer(root / "llama31", LLAMA31_STYLE)}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def decoded(tokenizer_dir: Path, dataset: PreparedDataset, i: int) -> tuple[str, list[str]]:
    """Sample ``i`` decoded whole, and each run of masked tokens decoded."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids, mask = dataset.sample(i)
    runs = np.split(ids[mask == 1], np.where(np.diff(np.flatnonzero(mask)) > 1)[0] + 1) if mask.any() else []
    return tokenizer.decode(ids), [tokenizer.decode(run) for run in runs]


def test_specforge_system_field_and_tool_turns_prepare_whole(tmp_path, tokenizers):
    source = write_jsonl(tmp_path / "in.jsonl", [SPECFORGE, SHAREGPT_SYSTEM, TOOLS])
    out = tmp_path / "data"
    proc = hsd("prepare", "--input", str(source), "--tokenizer", str(tokenizers["qwen3"]), "--out", str(out))
    assert "3 rows read (messages 1, sharegpt 1, sharegpt_role_content 1), 3 used, 0 skipped" in proc.stdout
    dataset = PreparedDataset(out)
    assert dataset.manifest["rows"]["skipped"] == 0 and len(dataset) == 3
    assert dataset.manifest["rows"]["formats"] == {"messages": 1, "sharegpt": 1, "sharegpt_role_content": 1}

    text, masked = decoded(tokenizers["qwen3"], dataset, 0)
    assert masked == ["2 + 3 = 5.<|im_end|>", "<think>\n\n</think>\n\n4 + 4 = 8.<|im_end|>"]
    text, masked = decoded(tokenizers["qwen3"], dataset, 1)
    assert text.startswith("<|im_start|>system\nAnswer in one line.<|im_end|>\n<|im_start|>user\nSpell")
    assert masked == ["<think>\n\n</think>\n\nc - a - t.<|im_end|>"]
    text, masked = decoded(tokenizers["qwen3"], dataset, 2)
    assert "<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>" in text
    assert masked == ['<tool_call>\n{"name": "multiply", "arguments": {"a": 4, "b": 6}}\n</tool_call><|im_end|>',
                      "<think>\n\n</think>\n\n4 times 6 is 24.<|im_end|>"]


def test_llama_style_tool_turns_and_the_system_field(tmp_path, tokenizers):
    prepare_dataset(write_jsonl(tmp_path / "in.jsonl", [SHAREGPT_SYSTEM, TOOLS]), tokenizers["llama31"],
                    tmp_path / "d", progress=False)
    dataset = PreparedDataset(tmp_path / "d")
    text, masked = decoded(tokenizers["llama31"], dataset, 0)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nAnswer in one line.<|eot_id|>")
    assert masked == ["c - a - t.<|eot_id|>"]
    text, masked = decoded(tokenizers["llama31"], dataset, 1)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n24<|eot_id|>" in text
    assert masked == ['{"name": "multiply", "parameters": {"a": 4, "b": 6}}<|eot_id|>', "4 times 6 is 24.<|eot_id|>"]


@pytest.mark.parametrize("conversation", [REASONING_IN_CONTENT, REASONING_APART], ids=["in_content", "apart"])
def test_two_reasoning_turns_under_a_template_that_drops_earlier_reasoning(tmp_path, tokenizers, conversation):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizers["qwen3"]))
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": conversation}])
    prepare_dataset(source, tokenizers["qwen3"], tmp_path / "whole", progress=False)
    dataset = PreparedDataset(tmp_path / "whole")
    assert dataset.manifest["rows"]["skipped"] == 0 and dataset.manifest["samples"] == "conversation"
    text, masked = decoded(tokenizers["qwen3"], dataset, 0)
    assert text == tokenizer.apply_chat_template(row_messages({"messages": conversation}), tokenize=False)
    # The first answer as the whole conversation's rendering shows it: its reasoning dropped.
    assert masked == ["It is 5.<|im_end|>", "<think>\nFive times two.\n</think>\n\nIt is 10.<|im_end|>"]

    prepare_dataset(source, tokenizers["qwen3"], tmp_path / "turns", per_turn=True, progress=False)
    dataset = PreparedDataset(tmp_path / "turns")
    assert len(dataset) == 2 and dataset.manifest["samples"] == "per_turn"
    assert dataset.manifest["rows"]["used"] == 1
    first, masked_first = decoded(tokenizers["qwen3"], dataset, 0)
    assert first.endswith("<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
                          "<think>\nTwo plus three.\n</think>\n\nIt is 5.<|im_end|>\n")
    assert masked_first == ["<think>\nTwo plus three.\n</think>\n\nIt is 5.<|im_end|>"]
    second, masked_second = decoded(tokenizers["qwen3"], dataset, 1)
    assert second == text  # the target saw the first answer without its reasoning
    assert masked_second == ["<think>\nFive times two.\n</think>\n\nIt is 10.<|im_end|>"]


def test_two_reasoning_turns_under_a_template_that_rewrites_nothing(tmp_path, tokenizers):
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": REASONING_IN_CONTENT}])
    prepare_dataset(source, tokenizers["llama31"], tmp_path / "whole", progress=False)
    text, masked = decoded(tokenizers["llama31"], PreparedDataset(tmp_path / "whole"), 0)
    assert masked == ["<think>\nTwo plus three.\n</think>\n\nIt is 5.<|eot_id|>",
                      "<think>\nFive times two.\n</think>\n\nIt is 10.<|eot_id|>"]
    prepare_dataset(source, tokenizers["llama31"], tmp_path / "turns", per_turn=True, progress=False)
    dataset = PreparedDataset(tmp_path / "turns")
    assert [decoded(tokenizers["llama31"], dataset, i)[1] for i in range(2)] == [[masked[0]], [masked[1]]]
    assert decoded(tokenizers["llama31"], dataset, 1)[0] == text


def test_chatml_masks_are_unchanged_by_the_new_shapes(tmp_path, tokenizers):
    """The same conversation in every turn shape prepares to the same tokens and mask."""
    turns = [("human", "user", "Spell the word dog."), ("gpt", "assistant", "d - o - g.")]
    rows = [{"conversations": [{"from": f, "value": t} for f, _, t in turns]},
            {"conversations": [{"role": r, "content": t} for _, r, t in turns]},
            {"messages": [{"from": f, "value": t, "weight": 1} for f, _, t in turns]},
            {"messages": [{"role": r, "content": [{"type": "text", "text": t}]} for _, r, t in turns]}]
    prepare_dataset(write_jsonl(tmp_path / "in.jsonl", rows), tokenizers["chatml"], tmp_path / "d", progress=False)
    dataset = PreparedDataset(tmp_path / "d")
    assert dataset.manifest["rows"]["formats"] == {"messages": 1, "messages_from_value": 1, "sharegpt": 1,
                                                   "sharegpt_role_content": 1}
    samples = [tuple(a.tolist() for a in dataset.sample(i)) for i in range(4)]
    assert samples[1:] == samples[:1] * 3
    assert decoded(tokenizers["chatml"], dataset, 0)[1] == ["d - o - g.<|im_end|>"]
