"""dispatcher/journal.py: checksummed records, torn tails repaired on open, fail-closed fsync, segments."""

import json
import random
import zlib

import pytest

from common import faults
from dispatcher.journal import (JOURNAL_NAME, Journal, JournalFailed, decode_line, encode_line, event_line,
                                read_journal, segment_paths)
from dispatcher.recovery import recover


def test_record_and_read(tmp_path):
    journal = Journal(tmp_path)
    journal.record("epoch", durable=True, epoch=0, jobs=3)
    journal.record("ready", job=1, w="t0.0")
    journal.close()
    events = list(read_journal(tmp_path))
    assert [e["ev"] for e in events] == ["epoch", "ready"]
    assert events[0]["jobs"] == 3 and "t" in events[0]


def test_a_record_with_a_wrong_checksum_is_not_read(tmp_path):
    line = encode_line({"ev": "commit", "step": 1})
    assert decode_line(line) == {"ev": "commit", "step": 1}
    assert decode_line(line.replace(b'"step":1', b'"step":2')) is None   # one changed byte
    assert decode_line(line[:-1]) is None                                  # no newline: torn


def test_a_record_is_byte_for_byte_the_json_of_its_merged_map():
    """The fast encoding of record() writes what json.dumps of {"ev", "t": round(now, 6), **fields} wrote
    (a journal of an older dispatcher and of this one read alike, checksums included)."""
    rng = random.Random(0)
    for i in range(20_000):
        now = rng.uniform(1.7e9, 2.2e9) if i % 5 else round(rng.uniform(1.7e9, 2.2e9), rng.randrange(7))
        fields = {"job": i, "w": "d1.0", "busy_s": round(rng.random(), 6), "buckets": [1, 2], "mixed": i % 2 == 0,
                  "avail": None, "reason": "lease_expired: \u00e9\n"} if i % 3 else {}
        expected = json.dumps({"ev": "ready", "t": round(now, 6), **fields}, separators=(",", ":")).encode()
        assert event_line("ready", fields, now) == b"%08x " % zlib.crc32(expected) + expected + b"\n"
    assert event_line("x", {"t": 1}, 5.0) == encode_line({"ev": "x", "t": 1})  # a field named t wins, as before


def test_torn_tail_is_cut_on_open_so_the_next_record_survives(tmp_path):
    journal = Journal(tmp_path)
    journal.record("epoch", durable=True, epoch=0)
    journal.close()
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(encode_line({"ev": "rollback", "model": "m", "step": 0})[:17])   # a power cut mid-write
    reopened = Journal(tmp_path)
    reopened.record("rollback", durable=True, model="m", step=0)
    reopened.close()
    assert [e["ev"] for e in read_journal(tmp_path)] == ["epoch", "rollback"]   # not glued onto the torn line


def test_fsync_failure_fails_closed(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=1")
    journal = Journal(tmp_path)
    journal.record("epoch", durable=True, epoch=0)
    with pytest.raises(JournalFailed, match="fsync"):
        journal.record("commit", durable=True, step=1)
    with pytest.raises(JournalFailed):
        journal.record("ready", job=1)   # nothing more is written after a failure
    journal.close()


def test_background_fsync_failure_is_reported_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=0")
    journal = Journal(tmp_path, sync_in_background=True)
    journal.record("commit", durable=True, step=1)
    import select
    assert select.select([journal.notify_fd], [], [], 5.0)[0]
    journal.drain_notifications()
    assert journal.failed is not None and journal.unsynced
    journal.close()


def test_background_sync_catches_up_and_notifies(tmp_path):
    journal = Journal(tmp_path, sync_in_background=True)
    for step in range(5):
        journal.record("commit", durable=True, step=step)
    import select
    while journal.unsynced:
        select.select([journal.notify_fd], [], [], 5.0)
        journal.drain_notifications()
    assert journal.synced_seq == 5
    journal.close()


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_rotation_makes_segments_read_in_order(tmp_path, background):
    journal = Journal(tmp_path, sync_in_background=background)
    journal.record("epoch", durable=True, epoch=0)
    journal.record("ready", job=0)
    journal.rotate(0)
    journal.record("commit", durable=True, model="m", step=1, jobs=[0])
    journal.rotate(1)
    journal.record("checkpoint", durable=True, model="m", step=1)
    journal.wait_rotated(1)  # background: the thread wrote, fsynced and renamed both segments
    assert journal.rotated_segment == 1 and (tmp_path / "journal-000001.jsonl").exists()
    journal.close()
    assert journal.synced_seq == 3
    assert [p.name for p in segment_paths(tmp_path)] == ["journal-000000.jsonl", "journal-000001.jsonl", JOURNAL_NAME]
    assert [e["ev"] for e in read_journal(tmp_path)] == ["epoch", "ready", "commit", "checkpoint"]
    assert [e["ev"] for e in read_journal(tmp_path, after=0)] == ["commit", "checkpoint"]
    assert [e["ev"] for e in read_journal(tmp_path, only=("checkpoint",))] == ["checkpoint"]


def test_recover_without_snapshot_reads_every_segment(tmp_path):
    journal = Journal(tmp_path)
    journal.record("start", durable=True)
    journal.record("epoch", durable=True, epoch=0)
    journal.record("commit", durable=True, model="m", step=1, jobs=[0, 1])
    journal.record("ready", job=2)
    journal.record("rollback", durable=True, model="m", step=0, jobs=2)
    journal.close()
    recovered = recover(tmp_path)
    assert recovered.num_starts == 1 and recovered.epochs_started == [0] and recovered.snapshot is None
    assert [e["ev"] for e in recovered.events] == ["commit", "rollback"]


def test_a_failed_fsync_while_closing_a_segment_fails_the_waiting_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=0")
    journal = Journal(tmp_path, sync_in_background=True)
    journal.record("epoch", durable=True, epoch=0)
    journal.rotate(0)
    with pytest.raises(JournalFailed, match="before segment 0 was closed"):
        journal.wait_rotated(0)
    assert journal.failed is not None and not (tmp_path / "journal-000000.jsonl").exists()
    journal.close()
