"""common/run/prepared.py's validate_prepared: each way a prepared dataset can be damaged is refused
in one pass, naming the file, what is wrong and the first bad sample; a whole one passes."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from prepared_data import write_prepared

from common.run.prepared import (CHECKSUM_BLOCK_BYTES, LENGTHS_FILE, LOSS_MASK_FILE, MANIFEST_FILE, OFFSETS_FILE,
                                 TOKENS_FILE, BlockChecksums, DataError, PreparedDataset, file_checksums,
                                 validate_prepared)

LENGTHS = [5, 9, 3519, 7, 12] + [3 + i % 11 for i in range(115)]  # 120 samples


@pytest.fixture
def data(tmp_path):
    return write_prepared(tmp_path / "data", LENGTHS)


def refused(path) -> str:
    with pytest.raises(DataError) as info:
        validate_prepared(path)
    message = str(info.value)
    assert "run hsd prepare again" in message or "run hsd prepare" in message
    return message


def test_a_whole_dataset_passes_with_its_checksums(data):
    summary = validate_prepared(data)
    assert summary.lengths.tolist() == LENGTHS and summary.num_samples == 120
    assert summary.num_tokens == sum(LENGTHS) and summary.checksummed
    assert PreparedDataset(data).lengths.tolist() == LENGTHS


def test_lengths_missing_its_last_lines(data):
    lines = (data / LENGTHS_FILE).read_text().splitlines(keepends=True)
    (data / LENGTHS_FILE).write_text("".join(lines[:100]))
    message = refused(data)
    assert LENGTHS_FILE in message and "holds 100 lengths" in message and "120 samples" in message
    assert "sample 100 (line 101)" in message


def test_a_length_cut_short_names_its_line_and_sample(data):
    lines = (data / LENGTHS_FILE).read_text().splitlines(keepends=True)
    lines[2] = "35\n"  # 3519 cut to its first two digits: it still parses
    (data / LENGTHS_FILE).write_text("".join(lines))
    message = refused(data)
    assert f"{data / LENGTHS_FILE}: line 3 says sample 2 has 35 tokens, offsets.u64 gives it 3519" in message


def test_a_length_that_does_not_parse_names_its_line(data):
    for bad in ("35x\n", "\n", "-4\n", "0\n"):
        lines = (data / LENGTHS_FILE).read_text().splitlines(keepends=True)
        original = lines[3]
        lines[3] = bad
        (data / LENGTHS_FILE).write_text("".join(lines))
        message = refused(data)
        assert f"{data / LENGTHS_FILE}: line 4 (sample 3) is {bad.strip()!r}, not a positive length" in message
        lines[3] = original
        (data / LENGTHS_FILE).write_text("".join(lines))
    validate_prepared(data)


@pytest.mark.parametrize("name, itemsize", [(TOKENS_FILE, 4), (LOSS_MASK_FILE, 1)])
def test_a_truncated_token_or_mask_file_names_the_first_cut_sample(data, name, itemsize):
    keep = sum(LENGTHS[:3]) - 1  # sample 2 loses its last token, the later ones everything
    with open(data / name, "r+b") as f:
        f.truncate(keep * itemsize)
    message = refused(data)
    assert str(data / name) in message and f"{keep} tokens" in message
    assert "sample 2 is the first cut short" in message
    with pytest.raises(DataError, match="do not match the manifest"):  # what a worker opening it says
        PreparedDataset(data)


def test_a_token_cut_in_two_and_a_file_missing(data):
    with open(data / TOKENS_FILE, "ab") as f:
        f.write(b"\0\0")
    assert "a token cut in two" in refused(data)
    (data / TOKENS_FILE).unlink()
    message = refused(data)
    assert f"{data / TOKENS_FILE} is missing" in message


def test_offsets_short_of_the_manifest_count(data):
    with open(data / OFFSETS_FILE, "r+b") as f:
        f.truncate(8 * 50)
    message = refused(data)
    assert str(data / OFFSETS_FILE) in message and "50 offsets" in message and "121" in message


@pytest.mark.parametrize("name", [TOKENS_FILE, LOSS_MASK_FILE])
def test_a_changed_byte_fails_its_checksum_naming_the_file(data, name):
    content = bytearray((data / name).read_bytes())
    content[len(content) // 2] ^= 0x40  # same size, same structure: only the checksum sees it
    (data / name).write_bytes(bytes(content))
    message = refused(data)
    assert str(data / name) in message and "differ from what hsd prepare wrote" in message
    assert "from sample 0 on" in message  # the first sample of the (only) damaged block


def test_the_damaged_block_names_its_first_sample(tmp_path, monkeypatch):
    monkeypatch.setattr("common.run.prepared.CHECKSUM_BLOCK_BYTES", 64)
    data = write_prepared(tmp_path / "d", LENGTHS)
    content = bytearray((data / TOKENS_FILE).read_bytes())
    token = sum(LENGTHS[:40]) + 1  # inside sample 40
    content[4 * token] ^= 1
    (data / TOKENS_FILE).write_bytes(bytes(content))
    message = refused(data)
    block_start = (4 * token) // 64 * 64
    first = int(np.searchsorted(np.cumsum([0] + LENGTHS), block_start // 4, side="right")) - 1
    assert f"bytes {block_start}-{block_start + 64} " in message and f"from sample {first} on" in message


def test_an_old_manifest_without_checksums_is_checked_by_sizes(tmp_path, caplog):
    data = write_prepared(tmp_path / "old", LENGTHS, checksums=False)
    with caplog.at_level(logging.INFO, logger="hsd.data"):
        summary = validate_prepared(data)
    assert not summary.checksummed and summary.lengths.tolist() == LENGTHS
    assert [r.getMessage() for r in caplog.records] == [
        f"{data / MANIFEST_FILE} records no checksums (written by an older hsd prepare): {data} checked by sizes only"]
    (data / LENGTHS_FILE).write_text("".join(f"{n}\n" for n in LENGTHS[:-20]))
    assert "holds 100 lengths" in refused(data)


def test_a_manifest_that_does_not_parse(data):
    (data / MANIFEST_FILE).write_text('{"format": "hsd-prep')
    assert str(data / MANIFEST_FILE) in refused(data)


def test_block_checksums_do_not_depend_on_how_the_bytes_were_fed(tmp_path):
    payload = np.random.default_rng(0).bytes(CHECKSUM_BLOCK_BYTES + 1000)
    fed = BlockChecksums()
    for start in range(0, len(payload), 777_777):
        fed.update(payload[start:start + 777_777])
    (tmp_path / "f").write_bytes(payload)
    assert fed.record() == file_checksums(tmp_path / "f")
    assert len(fed.record()["crc32"]) == 2 and fed.record()["bytes"] == len(payload)


def test_prepare_records_what_it_wrote(tmp_path):
    data = write_prepared(tmp_path / "d", [4, 5, 6])
    recorded = json.loads((data / MANIFEST_FILE).read_text())["checksums"]["files"]
    for name in (TOKENS_FILE, LOSS_MASK_FILE, OFFSETS_FILE, LENGTHS_FILE):
        assert recorded[name] == file_checksums(data / name)
