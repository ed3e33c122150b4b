"""hsd prepare: bad rows reported by line and skipped, assistant-only loss mask checked token by
token, the three row formats, Parquet, folders of shards, and failure when nothing is usable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hsd_testing import hsd
from tiny_tokenizers import save_tiny_tokenizer

from common.run.config import load_config
from common.run.prepared import LENGTHS_FILE, MANIFEST_FILE, PreparedDataset
from common.run.records.lengths import load_lengths
from target_worker.prepare import prepare_dataset

MULTI_TURN = [
    {"from": "system", "value": "You are a helpful assistant."},
    {"from": "human", "value": "Repeat these words: red cat."},
    {"from": "gpt", "value": "Repeat these words: red cat."},  # the answer repeats the question verbatim
    {"from": "human", "value": "Now say them in reverse."},
    {"from": "gpt", "value": "In reverse: cat red. That is all 2 of them backwards."},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def as_messages(turns: list[dict]) -> list[dict]:
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in turns]


def expected_mask(tokenizer, messages: list[dict]) -> list[int]:
    """Independent witness: for each assistant turn, the tokens between the prompt rendered with a
    generation prompt and the conversation rendered through that turn, minus the newline the
    template writes after the end-of-turn token."""
    def count(msgs, generation):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    mask = [0] * count(messages, False)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = count(messages[:i], True), count(messages[:i + 1], False) - 1
            mask[start:end] = [1] * (end - start)
    return mask


def test_bad_rows_are_reported_and_the_rest_is_prepared(tmp_path, tokenizer_dir, tokenizer):
    long_text = " ".join(["apple banana cherry"] * 40)
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"conversations": MULTI_TURN},                                            # 1 good
        '{"conversations": [{"from": "human", "value": "broken"',                 # 2 invalid JSON
        {"text": "no conversation here"},                                         # 3 missing fields
        {"conversations": []},                                                    # 4 empty conversation
        {"conversations": [{"from": "human", "value": "Spell the word cat."}]},  # 5 no assistant turn
        {"prompt": "Repeat these words: " + long_text, "response": long_text},   # 6 too long
        "",                                                                       # 7 blank: ignored
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"},          # 8 good
                      {"role": "assistant", "content": "2 + 3 = 5."}]},
        {"prompt": "Spell the word dog.", "response": "d - o - g."},              # 9 good
        {"conversations": [{"role": "human", "value": "wrong key"}]},            # 10 missing fields
    ])
    out = tmp_path / "data"
    proc = hsd("prepare", "--input", str(source), "--tokenizer", str(tokenizer_dir), "--out", str(out),
               "--max-length", "120")
    for line, reason in ((2, "invalid_json"), (3, "missing_fields"), (4, "empty_conversation"),
                         (5, "no_assistant_turn"), (6, "too_long"), (10, "missing_fields")):
        assert f"in.jsonl:{line}: skipped ({reason})" in proc.stderr, proc.stderr
    assert "in.jsonl:1:" not in proc.stderr and "in.jsonl:7:" not in proc.stderr
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["rows"]["skipped_by_reason"] == {"empty_conversation": 1, "invalid_json": 1,
                                                     "missing_fields": 2, "no_assistant_turn": 1, "too_long": 1}
    assert manifest["rows"]["read"] == 9 and manifest["rows"]["used"] == 3
    # Rows too long are known only once their chunk is tokenized, so they may be listed later.
    assert sorted(e["where"] for e in manifest["skipped_examples"]) == sorted(f"in.jsonl:{n}" for n in (2, 3, 4, 5, 6, 10))

    dataset = PreparedDataset(out)
    assert len(dataset) == 3 == manifest["num_samples"]
    lengths = [int(x) for x in (out / LENGTHS_FILE).read_text().split()]
    assert lengths == dataset.lengths.tolist() and sum(lengths) == manifest["num_tokens"]
    assert sum(h["count"] for h in manifest["lengths"]["histogram"]) == 3
    # The dispatcher's schedule reads the same lengths through data.path.
    prepared = load_config(None, [f"data.path={out}"])
    assert load_lengths(prepared.data, prepared.schedule, prepared.run) == lengths

    # Token by token: the mask is exactly the assistant turns (+ their end-of-turn token).
    messages = as_messages(MULTI_TURN)
    ids, mask = dataset.sample(0)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert mask.tolist() == expected_mask(tokenizer, messages)
    runs = np.split(ids[mask == 1], np.where(np.diff(np.flatnonzero(mask)) > 1)[0] + 1)
    assert [tokenizer.decode(run) for run in runs] == [m["content"] + "<|im_end|>" for m in messages
                                                        if m["role"] == "assistant"]
    assert manifest["num_loss_tokens"] == sum(int(dataset.sample(i)[1].sum()) for i in range(3))


def test_three_formats_parquet_and_folders_of_shards_agree(tmp_path, tokenizer_dir, caplog):
    question, answer = "Add 4 and 5.", "To add 4 and 5, we sum them: 4 + 5 = 9. The answer is 9."
    rows = [{"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]},
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]},
            {"prompt": question, "response": answer}]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", rows[:2])
    write_jsonl(shards / "b.jsonl", ["not json", rows[2]])
    (shards / "notes.txt").write_text("not a shard")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.Table.from_pylist([rows[0], rows[0]]), shards / "c.parquet")

    prepare_dataset(shards, tokenizer_dir, tmp_path / "d", progress=False)
    assert "b.jsonl:1: skipped (invalid_json)" in caplog.text
    dataset = PreparedDataset(tmp_path / "d")
    assert len(dataset) == 5
    first_ids, first_mask = dataset.sample(0)
    for i in range(1, 5):
        ids, mask = dataset.sample(i)
        assert ids.tolist() == first_ids.tolist() and mask.tolist() == first_mask.tolist()
    assert dataset.manifest["rows"]["formats"] == {"messages": 1, "prompt_response": 1, "sharegpt": 3}
    assert [f["name"] for f in dataset.manifest["source"]["files"]] == ["a.jsonl", "b.jsonl", "c.parquet"]


def test_fails_when_nothing_usable_remains(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"conversations": []}])
    proc = hsd("prepare", "--input", str(source), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "d"),
               check=False)
    assert proc.returncode != 0
    assert "no usable rows" in proc.stderr and "invalid_json: 1" in proc.stderr
    assert not (tmp_path / "d" / MANIFEST_FILE).exists()
    assert not list((tmp_path / "d").glob("*.partial"))
    missing = hsd("prepare", "--input", str(tmp_path / "nowhere.jsonl"), "--tokenizer", str(tokenizer_dir),
                  "--out", str(tmp_path / "e"), check=False)
    assert missing.returncode != 0 and "does not exist" in missing.stderr
