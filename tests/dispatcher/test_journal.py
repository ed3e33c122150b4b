"""dispatcher/journal.py: append-only events, torn lines, recovery of committed steps."""

import json
import time

from dispatcher.journal import JOURNAL_NAME, Journal, read_journal, recover


def write_events(run_dir, *events):
    journal = Journal(run_dir)
    for ev, fields in events:
        journal.record(ev, durable=ev in ("commit", "checkpoint", "epoch", "revert"), **fields)
    journal.close()


def test_record_and_read(tmp_path):
    journal = Journal(tmp_path)
    journal.record("epoch", durable=True, epoch=0, jobs=3)
    journal.record("ready", job=5, w="t0")
    # a durable record is on disk at once; a progress record once the journal is flushed
    assert [e["ev"] for e in read_journal(tmp_path)] == ["epoch"]
    journal.flush()
    events = list(read_journal(tmp_path))
    assert [e["ev"] for e in events] == ["epoch", "ready"]
    assert events[0]["epoch"] == 0 and events[0]["jobs"] == 3 and isinstance(events[0]["t"], float)
    assert events[1] == {"ev": "ready", "t": events[1]["t"], "job": 5, "w": "t0"}
    journal.close()
    journal.close()   # closing twice is harmless
    # a second journal on the same run dir appends
    again = Journal(tmp_path)
    again.record("start", resumed=True)
    again.close()
    assert [e["ev"] for e in read_journal(tmp_path)] == ["epoch", "ready", "start"]
    lines = (tmp_path / JOURNAL_NAME).read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines)


def test_read_missing_journal(tmp_path):
    assert list(read_journal(tmp_path)) == []
    assert recover(tmp_path).committed == set() and recover(tmp_path).next_step == 0


def test_torn_last_line_is_ignored(tmp_path):
    write_events(tmp_path, ("epoch", {"epoch": 0}), ("commit", {"step": 0, "jobs": [1], "checkpointed": True}))
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('{"ev":"commit","step":1,"jobs":[2,3')   # power cut mid-write
    events = list(read_journal(tmp_path))
    assert [e["ev"] for e in events] == ["epoch", "commit"]
    recovered = recover(tmp_path)
    assert recovered.committed == {1} and recovered.next_step == 1


def test_non_event_lines_are_skipped(tmp_path):
    (tmp_path / JOURNAL_NAME).write_text('[1,2]\n{"no_ev":1}\n{"ev":"epoch","epoch":2}\n')
    assert [e["ev"] for e in read_journal(tmp_path)] == ["epoch"]


def test_recover_keeps_checkpointed_and_reverts_the_rest(tmp_path):
    write_events(
        tmp_path,
        ("epoch", {"epoch": 0}),
        ("commit", {"step": 0, "jobs": [10, 11], "checkpointed": False}),
        ("commit", {"step": 1, "jobs": [12], "checkpointed": False}),
        ("checkpoint", {"step": 1}),
        ("commit", {"step": 2, "jobs": [13], "checkpointed": True}),
        ("epoch", {"epoch": 1}),
        ("commit", {"step": 3, "jobs": [14, 15], "checkpointed": False}),
        ("commit", {"step": 4, "jobs": [16]}),               # no flag: not checkpointed
        ("epoch", {"epoch": 1}),                            # named twice, listed once
    )
    recovered = recover(tmp_path)
    assert recovered.epochs_started == [0, 1]
    assert recovered.committed == {10, 11, 12, 13}
    assert recovered.steps_to_revert == [3, 4]
    assert recovered.next_step == 5


def test_checkpointed_commit_covers_every_earlier_step(tmp_path):
    # The model saved with step 1 already holds step 0: neither is reverted; step 2 after it is.
    write_events(tmp_path, ("epoch", {"epoch": 0}),
                 ("commit", {"step": 0, "jobs": [1], "checkpointed": False}),
                 ("commit", {"step": 1, "jobs": [2], "checkpointed": True}),
                 ("commit", {"step": 2, "jobs": [3], "checkpointed": False}))
    recovered = recover(tmp_path)
    assert recovered.committed == {1, 2}
    assert recovered.steps_to_revert == [2]


def test_revert_event_removes_steps(tmp_path):
    write_events(
        tmp_path,
        ("epoch", {"epoch": 0}),
        ("commit", {"step": 0, "jobs": [1], "checkpointed": True}),
        ("commit", {"step": 1, "jobs": [2], "checkpointed": False}),
        ("commit", {"step": 2, "jobs": [3], "checkpointed": False}),
        ("revert", {"steps": [1, 2]}),
        ("commit", {"step": 3, "jobs": [2], "checkpointed": True}),   # job 2 redone in a later step
        ("commit", {"step": 4, "jobs": [3], "checkpointed": False}),
    )
    recovered = recover(tmp_path)
    assert recovered.committed == {1, 2}
    assert recovered.steps_to_revert == [4]      # reverted steps are not reverted again
    assert recovered.next_step == 5              # step numbers are never reused


def test_later_checkpoint_covers_earlier_commits(tmp_path):
    write_events(tmp_path, ("epoch", {"epoch": 0}),
                 ("commit", {"step": 0, "jobs": [1]}), ("commit", {"step": 1, "jobs": [2]}),
                 ("commit", {"step": 2, "jobs": [3]}), ("checkpoint", {"step": 2}),
                 ("checkpoint", {"step": 1}))       # an older checkpoint arriving late does not undo
    recovered = recover(tmp_path)
    assert recovered.committed == {1, 2, 3} and recovered.steps_to_revert == []
    assert recovered.next_step == 3


def test_background_sync_catches_up_and_notifies(tmp_path):
    import select
    journal = Journal(tmp_path, sync_in_background=True)
    try:
        for step in range(50):
            journal.record("commit", durable=True, step=step, jobs=[step])
        assert journal.written_seq == 50
        deadline = time.monotonic() + 10
        while journal.synced_seq < journal.written_seq and time.monotonic() < deadline:
            select.select([journal.notify_fd], [], [], 0.5)
            journal.drain_notifications()
        assert journal.synced_seq == 50 and not journal.unsynced
        assert [e["step"] for e in read_journal(tmp_path) if e["ev"] == "commit"] == list(range(50))
    finally:
        journal.close()
    assert journal.synced_seq == journal.written_seq
