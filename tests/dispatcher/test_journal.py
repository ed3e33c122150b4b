"""dispatcher/journal.py, the writer, read back through common/run/records/journal.py: checksummed records, torn tails repaired on open, fail-closed fsync, segments."""

import json
import logging
import zlib

import pytest

from common import faults
from common.run.records.events import (Checkpointed, DispatcherStarted, EpochStarted, JobReady, ModelRolledBack,
                                       StepCommitted)
from common.run.records.journal import (JOURNAL_NAME, JournalCorrupt, encode_event, intact_body, read_journal,
                                        segment_paths)
from dispatcher.journal import Journal, JournalFailed
from dispatcher.recovery import recover


def commit(step, jobs=(0,), model="m"):
    return StepCommitted(model=model, step=step, jobs=list(jobs), w="d0.0")


def kinds(events):
    return [type(e) for e in events]


def test_record_and_read(tmp_path):
    journal = Journal(tmp_path)
    journal.record(EpochStarted(epoch=0, jobs=3), durable=True)
    journal.record(JobReady(job=1, w="t0.0"))
    journal.close()
    events = list(read_journal(tmp_path))
    assert kinds(events) == [EpochStarted, JobReady]
    assert events[0].jobs == 3 and events[0].t > 1.6e9 and events[1].w == "t0.0"


def test_a_record_is_the_checksummed_json_of_its_struct(tmp_path):
    """Kind first, then the time, then the fields in the struct's order; defaults are left out."""
    journal = Journal(tmp_path)
    journal.record(JobReady(job=7, w="t0.0", tokens=12, busy_s=0.5, t=12.25))
    journal.record(StepCommitted(model="m", step=1, jobs=[7], w="d0.0", buckets=[2], avail=None, mixed=True, t=13.0))
    journal.close()
    lines = (tmp_path / JOURNAL_NAME).read_bytes().splitlines(keepends=True)
    bodies = [b'{"ev":"ready","t":12.25,"job":7,"w":"t0.0","tokens":12,"busy_s":0.5}',
              b'{"ev":"commit","t":13.0,"model":"m","step":1,"jobs":[7],"w":"d0.0","buckets":[2]}']
    assert lines == [b"%08x %s\n" % (zlib.crc32(body), body) for body in bodies]


def test_a_record_with_a_wrong_checksum_is_not_read(tmp_path):
    line = encode_event(commit(1))
    assert intact_body(line) == line[9:-1]
    assert intact_body(line.replace(b'"step":1', b'"step":2')) is None   # one changed byte
    assert intact_body(line[:-1]) is None                                  # no newline: torn


def test_torn_tail_is_cut_on_open_so_the_next_record_survives(tmp_path):
    journal = Journal(tmp_path)
    journal.record(EpochStarted(epoch=0, jobs=1), durable=True)
    journal.close()
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(encode_event(ModelRolledBack(model="m", step=0))[:17])   # a power cut mid-write
    reopened = Journal(tmp_path)
    reopened.record(ModelRolledBack(model="m", step=0), durable=True)
    reopened.close()
    assert kinds(read_journal(tmp_path)) == [EpochStarted, ModelRolledBack]   # not glued onto the torn line


def test_an_unknown_kind_is_skipped_and_logged_once(tmp_path, caplog):
    """An older dispatcher's kind (``revert`` is gone) or a newer one's: skipped, not a failed restart."""
    lines = [json.dumps(doc, separators=(",", ":")).encode() for doc in (
        {"ev": "revert", "t": 1.0, "steps": [1]}, {"ev": "start", "t": 2.0}, {"ev": "revert", "t": 3.0, "steps": []})]
    (tmp_path / JOURNAL_NAME).write_bytes(b"".join(b"%08x %s\n" % (zlib.crc32(body), body) for body in lines))
    with caplog.at_level(logging.WARNING, logger="hsd.journal"):
        assert list(read_journal(tmp_path)) == [DispatcherStarted(t=2.0)]
    assert [r.getMessage() for r in caplog.records if "unknown kind 'revert'" in r.getMessage()] == [
        f"journal {tmp_path / JOURNAL_NAME}:1: skipped a record of unknown kind 'revert' (an older or newer "
        "dispatcher wrote it); the later ones of that kind are skipped too"]
    assert recover(tmp_path).num_starts == 1


def test_a_known_kind_whose_fields_do_not_fit_is_refused(tmp_path):
    """Its checksum holds, so no power cut made it: skipping it could drop a commit, so reading stops."""
    body = b'{"ev":"commit","t":1.0,"model":"m","step":"two","jobs":[1]}'
    (tmp_path / JOURNAL_NAME).write_bytes(b"%08x %s\n" % (zlib.crc32(body), body))
    with pytest.raises(JournalCorrupt, match=r"journal\.jsonl:1: a commit record that does not decode: .*\$\.step"):
        list(read_journal(tmp_path))
    Journal(tmp_path).close()  # an intact line: opening the journal keeps it
    assert (tmp_path / JOURNAL_NAME).read_bytes().endswith(body + b"\n")


def test_fsync_failure_fails_closed(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=1")
    journal = Journal(tmp_path)
    journal.record(EpochStarted(epoch=0, jobs=1), durable=True)
    with pytest.raises(JournalFailed, match="fsync"):
        journal.record(commit(1), durable=True)
    with pytest.raises(JournalFailed):
        journal.record(JobReady(job=1, w="t0.0"))   # nothing more is written after a failure
    journal.close()


def test_background_fsync_failure_is_reported_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=0")
    journal = Journal(tmp_path, sync_in_background=True)
    journal.record(commit(1), durable=True)
    import select
    assert select.select([journal.notify_fd], [], [], 5.0)[0]
    journal.drain_notifications()
    assert journal.failed is not None and journal.unsynced
    journal.close()


def test_background_sync_catches_up_and_notifies(tmp_path):
    journal = Journal(tmp_path, sync_in_background=True)
    for step in range(5):
        journal.record(commit(step), durable=True)
    import select
    while journal.unsynced:
        select.select([journal.notify_fd], [], [], 5.0)
        journal.drain_notifications()
    assert journal.synced_seq == 5
    journal.close()


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_rotation_makes_segments_read_in_order(tmp_path, background):
    journal = Journal(tmp_path, sync_in_background=background)
    journal.record(EpochStarted(epoch=0, jobs=1), durable=True)
    journal.record(JobReady(job=0, w="t0.0"))
    journal.rotate(0)
    journal.record(commit(1), durable=True)
    journal.rotate(1)
    journal.record(Checkpointed(model="m", step=1), durable=True)
    journal.wait_rotated(1)  # background: the thread wrote, fsynced and renamed both segments
    assert journal.rotated_segment == 1 and (tmp_path / "journal-000001.jsonl").exists()
    journal.close()
    assert journal.synced_seq == 3
    assert [p.name for p in segment_paths(tmp_path)] == ["journal-000000.jsonl", "journal-000001.jsonl", JOURNAL_NAME]
    assert kinds(read_journal(tmp_path)) == [EpochStarted, JobReady, StepCommitted, Checkpointed]
    assert kinds(read_journal(tmp_path, after=0)) == [StepCommitted, Checkpointed]
    assert kinds(read_journal(tmp_path, only=(Checkpointed,))) == [Checkpointed]


def test_recover_without_snapshot_reads_every_segment(tmp_path):
    journal = Journal(tmp_path)
    journal.record(DispatcherStarted(), durable=True)
    journal.record(EpochStarted(epoch=0, jobs=3), durable=True)
    journal.record(commit(1, jobs=[0, 1]), durable=True)
    journal.record(JobReady(job=2, w="t0.0"))
    journal.record(ModelRolledBack(model="m", step=0, jobs=2), durable=True)
    journal.close()
    recovered = recover(tmp_path)
    assert recovered.num_starts == 1 and recovered.epochs_started == [0] and recovered.snapshot is None
    assert kinds(recovered.events) == [StepCommitted, ModelRolledBack]


def test_a_failed_fsync_while_closing_a_segment_fails_the_waiting_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "journal_fsync_fails_after=0")
    journal = Journal(tmp_path, sync_in_background=True)
    journal.record(EpochStarted(epoch=0, jobs=1), durable=True)
    journal.rotate(0)
    with pytest.raises(JournalFailed, match="closing segment 0 of the journal .* failed: fsync failed"):
        journal.wait_rotated(0)
    assert journal.failed is not None and not (tmp_path / "journal-000000.jsonl").exists()
    journal.close()
