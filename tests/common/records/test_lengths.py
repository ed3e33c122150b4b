"""common/run/records/lengths.py: lengths files, prepared datasets checked whole, the synthetic length mix,
and the samples too long for the schedule."""

from collections import Counter

import pytest
from prepared_data import write_prepared

from common.run.config import load_config
from common.run.prepared import DataError
from common.run.records.lengths import (SYNTHETIC_SHARES, DatasetError, load_lengths, read_lengths_file,
                                        synthetic_lengths, too_long_line, too_long_samples)
from common.run.records.schedule import assign_buckets


def test_read_lengths_file(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("# header\n12\n\n  7 \n300\n")
    assert read_lengths_file(path) == [12, 7, 300]


def test_missing_lengths_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        read_lengths_file(tmp_path / "nope.txt")


def test_non_integer_line_names_its_line_number(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("12\n13\nfourteen\n15\n")
    with pytest.raises(DatasetError) as info:
        read_lengths_file(path)
    assert f"{path}:3" in str(info.value)
    assert "fourteen" in str(info.value)


@pytest.mark.parametrize("bad", ["0", "-5", "1.5"])
def test_bad_length_value(tmp_path, bad):
    path = tmp_path / "l.txt"
    path.write_text(f"4\n{bad}\n")
    with pytest.raises(DatasetError, match=":2:"):
        read_lengths_file(path)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_lengths_file(tmp_path, text):
    path = tmp_path / "l.txt"
    path.write_text(text)
    with pytest.raises(DatasetError, match="no lengths"):
        read_lengths_file(path)


def test_synthetic_lengths_shares():
    buckets = [256, 512, 1024, 2048, 4096, 8192]
    lengths = synthetic_lengths(10_000, buckets, seed=3)
    assert len(lengths) == pytest.approx(10_000, abs=6)
    assignment = assign_buckets(lengths, buckets)
    assert -1 not in assignment and min(lengths) >= 1
    counts = Counter(assignment)
    for b, share in enumerate(SYNTHETIC_SHARES):
        assert counts[b] / len(lengths) == pytest.approx(share, abs=0.002)
    # shuffled: the first thousand already holds every bucket
    assert set(assign_buckets(lengths[:1000], buckets)) == set(range(6))


def test_synthetic_lengths_deterministic_and_seeded():
    buckets = [64, 128, 256]
    assert synthetic_lengths(500, buckets, seed=1) == synthetic_lengths(500, buckets, seed=1)
    assert synthetic_lengths(500, buckets, seed=1) != synthetic_lengths(500, buckets, seed=2)


def test_synthetic_lengths_more_buckets_than_shares():
    buckets = [16, 32, 64, 128, 256, 512, 1024, 2048]
    lengths = synthetic_lengths(2000, buckets, seed=0)
    counts = Counter(assign_buckets(lengths, buckets))
    assert -1 not in counts and set(counts) == set(range(8))
    # the last share repeats past six buckets
    assert counts[6] == pytest.approx(counts[5], abs=2) and counts[7] == pytest.approx(counts[5], abs=2)


def _lengths_of(overrides: list[str]) -> list[int]:
    config = load_config(None, overrides)
    return load_lengths(config.data, config.schedule, config.run)


def test_load_lengths_from_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "l.txt").write_text("5\n6\n")
    assert _lengths_of(["data.lengths=l.txt"]) == [5, 6]
    (tmp_path / "ds").mkdir()
    with pytest.raises(DataError, match="no manifest.json"):
        _lengths_of(["data.path=ds"])
    write_prepared(tmp_path / "ds", [9, 4])
    assert _lengths_of(["data.path=ds"]) == [9, 4]
    (tmp_path / "ds" / "lengths.txt").write_text("9\n")  # a dataset's lengths are checked whole
    with pytest.raises(DataError, match="sample 1 \\(line 2\\)"):
        _lengths_of(["data.path=ds"])
    synthetic = _lengths_of(["data.synthetic_samples=300"])
    assert len(synthetic) == pytest.approx(300, abs=6)


def test_samples_too_long_for_the_last_bucket_are_named():
    lengths = [10, 3519, 256, 257, 5] + [300] * 6
    too_long = too_long_samples(lengths, [128, 256])
    assert too_long.tolist() == [1, 3, 5, 6, 7, 8, 9, 10]
    assert too_long_line(too_long, lengths, 256) == (
        "8 of 11 samples are longer than the last bucket (256) and no epoch trains them: sample 1 (3519 tokens), "
        "3 (257 tokens), 5 (300 tokens), 6 (300 tokens), 7 (300 tokens) and 3 more; raise schedule.buckets' last, "
        "or prepare with --max-length 256 to leave them out")
    assert too_long_samples([1, 256], [128, 256]).tolist() == []
