"""common/run/durable.py: atomic_write and publish — whole or not at all, fsynced only when asked."""

import os
import stat

import pytest

from common.run import durable
from common.run.durable import atomic_write, publish


@pytest.fixture
def fsyncs(monkeypatch):
    """The fds fsynced, as 'dir' or 'file'."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd):
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)
    monkeypatch.setattr(durable.os, "fsync", fsync)
    return seen


def test_text_bytes_and_a_callback_each_replace_the_file(tmp_path, fsyncs):
    path = tmp_path / "a.json"
    path.write_text("old")
    assert atomic_write(path, "new") == path and path.read_text() == "new"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(path, lambda tmp: tmp.write_text("from a writer that takes a name"))
    assert path.read_text() == "from a writer that takes a name"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    assert fsyncs == []  # not durable: renamed only


def test_durable_fsyncs_the_file_then_its_directory(tmp_path, fsyncs):
    atomic_write(tmp_path / "latest", "step-00000004\n", durable=True, tmp_name=".latest.tmp")
    assert fsyncs == ["file", "dir"] and (tmp_path / "latest").read_text() == "step-00000004\n"


def test_a_directory_is_fsynced_whole_and_replaces_the_old_one(tmp_path, fsyncs):
    final = tmp_path / "snap"
    final.mkdir()
    (final / "stale").write_text("x")
    seen_before_publish = []

    def build(tmp):
        tmp.mkdir()
        (tmp / "one").write_text("1")
        (tmp / "two").write_text("2")
    atomic_write(final, build, durable=True, tmp_name=".tmp-snap", before_publish=seen_before_publish.append)
    assert sorted(p.name for p in final.iterdir()) == ["one", "two"]
    assert seen_before_publish == [tmp_path / ".tmp-snap"]
    assert fsyncs == ["file", "file", "dir", "dir"]  # both files, the new directory, then its parent
    assert not (tmp_path / ".tmp-snap").exists()


def test_a_stale_temporary_directory_is_removed_first(tmp_path):
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "left-by-a-killed-writer").write_text("x")
    atomic_write(tmp_path / "out", lambda tmp: tmp.mkdir())
    assert list((tmp_path / "out").iterdir()) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_text("old")

    def fails(tmp):
        tmp.write_text("half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fails)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_mode_is_set_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "config.json", "{}", mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == 0o644


def test_publish_renames_a_file_written_over_many_calls(tmp_path, fsyncs):
    tmp = tmp_path / "tokens.bin.partial"
    with open(tmp, "wb") as f:
        f.write(b"a")
        f.write(b"b")
    publish(tmp, tmp_path / "tokens.bin")
    assert (tmp_path / "tokens.bin").read_bytes() == b"ab" and not tmp.exists() and fsyncs == []
