"""common/run/prepared.py: the reader's views and checks, and the tokenizer fingerprint refusal."""

from __future__ import annotations

import json

import pytest
from tiny_tokenizers import save_tiny_tokenizer

from common.run.config import ScheduleSection
from common.run.prepared import (MANIFEST_FILE, TOKENS_FILE, PreparedDataset, check_tokenizer, tokenizer_fingerprint,
                                 validate_prepared)
from target_worker.prepare import prepare_dataset

ROWS = [{"prompt": "Spell the word cat.", "response": "The word cat is spelled c - a - t. It has 3 letters."},
        {"prompt": "What is 1 plus 2?", "response": "1 + 2 = 3."}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two different tokenizers: A and B differ in their vocabulary size."""
    root = tmp_path_factory.mktemp("tokenizers")
    return (save_tiny_tokenizer(root / "a", vocab_size=400), save_tiny_tokenizer(root / "b", vocab_size=300))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("data")
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    prepare_dataset(source, tokenizers[0], root / "prepared", progress=False)
    return root / "prepared"


def test_reader_views_and_fingerprint(dataset_dir, tokenizers):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizers[0]))
    dataset = PreparedDataset(dataset_dir)
    assert len(dataset) == 2
    ids, mask = dataset.sample(-1)
    assert tokenizer.decode(ids[mask == 1]) == "1 + 2 = 3.<|im_end|>"
    assert dataset.lengths.tolist() == [len(dataset.sample(i)[0]) for i in range(2)]
    with pytest.raises(IndexError):
        dataset.sample(2)
    assert dataset.fingerprint == tokenizer_fingerprint(tokenizer)
    tokenizer(["a", "bb"], padding=True)  # runtime padding settings do not change the fingerprint
    assert dataset.fingerprint == tokenizer_fingerprint(tokenizer)
    check_tokenizer(dataset, tokenizers[0])  # the same tokenizer: accepted


def test_prepare_writes_checksums_and_keeps_what_the_default_schedule_places(dataset_dir):
    summary = validate_prepared(dataset_dir)
    assert summary.checksummed and summary.lengths.tolist() == PreparedDataset(dataset_dir).lengths.tolist()
    manifest = json.loads((dataset_dir / MANIFEST_FILE).read_text())
    assert set(manifest["checksums"]["files"]) == {"tokens.u32", "loss_mask.u8", "offsets.u64", "lengths.txt"}
    assert manifest["max_length"] == ScheduleSection().buckets[-1]  # the default path drops nothing


def test_refuses_a_dataset_prepared_with_another_tokenizer(dataset_dir, tokenizers):
    fingerprint_a = PreparedDataset(dataset_dir).fingerprint
    with pytest.raises(ValueError) as refused:
        check_tokenizer(dataset_dir, tokenizers[1])
    from transformers import AutoTokenizer
    fingerprint_b = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tokenizers[1])))
    assert fingerprint_a != fingerprint_b
    assert fingerprint_a in str(refused.value) and fingerprint_b in str(refused.value)


def test_refuses_unfinished_or_inconsistent_directories(tmp_path, dataset_dir):
    with pytest.raises(ValueError, match="not a prepared dataset"):
        PreparedDataset(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in dataset_dir.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    with open(broken / TOKENS_FILE, "ab") as tokens:
        tokens.write(b"\0\0\0\0")
    with pytest.raises(ValueError, match="do not match the manifest"):
        PreparedDataset(broken)
    manifest = json.loads((broken / MANIFEST_FILE).read_text())
    (broken / MANIFEST_FILE).write_text(json.dumps(dict(manifest, format="other")))
    with pytest.raises(ValueError, match="unknown dataset format"):
        PreparedDataset(broken)
