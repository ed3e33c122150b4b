"""Damaged run files (docs/corruption.md): a torn tail is cut, anything else damaged is never cut and
never skipped where a restart needs it; a damaged snapshot falls back to an older state, saying so
in a line that names the file, or the restart refuses, naming it."""

import json
import logging
import os
import zlib
from collections import Counter

import pytest

from common import faults
from core_harness import Model, ModelSim, all_job_ids, make_core, register, register_models, small_lengths, witness_counts
from common.run.records.events import EpochStarted, JobReady, StepCommitted
from common.run.records.journal import JOURNAL_NAME, JournalDamaged, encode_event, read_journal
from dispatcher.journal import Journal, JournalFailed, repair_tail
from dispatcher.recovery import SnapshotDamaged, array_file, recover, snapshot_dirs


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


def line_offsets(path):
    """(start, line) of each line of ``path``."""
    out, at = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        out.append((at, line))
        at += len(line)
    return out


def started_run(tmp_path, *, steps, snapshot_at=None):
    """A core run to ``steps`` commits (a snapshot at ``snapshot_at`` steps), closed as a crash leaves it."""
    lengths = small_lengths(scale=4)
    models = [Model("m0")]
    core = make_core(tmp_path, lengths=lengths)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=1)
    if snapshot_at is not None:
        sim.run(until=lambda s: s.core.num_steps >= snapshot_at)
        assert core.maybe_snapshot(force=True)
        core.store.wait_for_snapshot()
    sim.run(until=lambda s: s.core.num_steps >= steps)
    core.journal.close()
    core.close()
    return lengths, models


def finish(tmp_path, lengths, models):
    resumed = make_core(tmp_path, lengths=lengths)
    ModelSim(resumed, register(resumed, "target", 2), register_models(resumed, models)).run()
    assert resumed.done
    assert witness_counts(models) == Counter(all_job_ids(resumed))  # every job exactly once
    resumed.journal.close()
    resumed.close()


# -- the journal ------------------------------------------------------------------------------------
def test_only_the_unterminated_tail_is_cut_and_a_damaged_line_before_it_stays(tmp_path):
    journal = Journal(tmp_path)
    for step in (1, 2, 3):
        journal.record(StepCommitted(model="m", step=step, jobs=[step], w="d"), durable=True)
    journal.close()
    path = tmp_path / JOURNAL_NAME
    flip(path, line_offsets(path)[1][0] + 30)          # the middle record: damaged, not torn
    with open(path, "ab") as f:
        f.write(encode_event(JobReady(job=9, w="t"))[:20])  # a record cut short: the torn tail
    size = path.stat().st_size
    assert repair_tail(path) == 20
    assert path.stat().st_size == size - 20            # the three records, the damaged one included, stay
    with pytest.raises(JournalDamaged, match=r"journal\.jsonl, line 2: damaged \(a 'commit' record"):
        list(read_journal(tmp_path))


def test_a_flipped_byte_in_a_live_commit_refuses_the_restart_and_cuts_nothing(tmp_path):
    """Before: the first unparsable line was taken for a torn tail and every record after it cut."""
    started_run(tmp_path, steps=6)
    path = tmp_path / JOURNAL_NAME
    commits = [(at, line) for at, line in line_offsets(path) if b'"ev":"commit"' in line]
    flip(path, commits[2][0] + 40)
    before = path.read_bytes()
    with pytest.raises(JournalDamaged) as refused:
        make_core(tmp_path, lengths=small_lengths(scale=4))
    assert refused.value.path == path and refused.value.kind == "commit"
    assert "Restore this file" in str(refused.value)
    assert path.read_bytes() == before


def test_a_flipped_byte_in_a_progress_record_is_passed_over_by_name_and_the_run_ends_exactly_once(tmp_path, caplog):
    lengths, models = started_run(tmp_path, steps=6)
    path = tmp_path / JOURNAL_NAME
    ready = [(number, at) for number, (at, line) in enumerate(line_offsets(path), 1) if b'"ev":"ready"' in line]
    number, at = ready[3]
    flip(path, at + 30)
    with caplog.at_level(logging.WARNING, logger="hsd.journal"):
        finish(tmp_path, lengths, models)
    assert f"journal {path}:{number}: skipped a damaged 'ready' record" in caplog.text
    damaged = []
    list(read_journal(tmp_path, damaged=damaged))
    assert damaged == [(path, number, "ready")]


def test_a_flipped_byte_in_the_kind_of_a_record_is_never_taken_for_another_kind(tmp_path):
    """A restart reads a few kinds and passes over the others undecoded: a record whose kind field
    is damaged might be a commit, so it refuses (before, such a line was skipped unread)."""
    started_run(tmp_path, steps=4)
    path = tmp_path / JOURNAL_NAME
    at, line = next((at, line) for at, line in line_offsets(path) if b'"ev":"commit"' in line)
    flip(path, at + line.index(b"commit"))
    with pytest.raises(JournalDamaged, match="a record whose kind cannot be read"):
        recover(tmp_path)


def test_a_damaged_commit_in_a_closed_segment_refuses_without_the_snapshot_and_resumes_with_it(tmp_path):
    """Before: the replay skipped the line, forgot the commit, and its jobs were trained twice."""
    lengths, models = started_run(tmp_path, steps=7, snapshot_at=4)
    segment = tmp_path / "journal-000000.jsonl"
    at, _ = [(at, line) for at, line in line_offsets(segment) if b'"ev":"commit"' in line][1]
    flip(segment, at + 40)
    finish(tmp_path, lengths, models)       # the snapshot holds that commit: the restart never reads it
    with pytest.raises(JournalDamaged, match="journal-000000.jsonl, line"):
        list(read_journal(tmp_path))        # the report's reader refuses to count without it
    for snap in snapshot_dirs(tmp_path):
        for name in os.listdir(snap):
            os.remove(snap / name)
        os.rmdir(snap)
    with pytest.raises(JournalDamaged, match="journal-000000.jsonl, line"):
        recover(tmp_path)


# -- snapshots ------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["array byte", "array cut", "state missing", "state byte"])
def test_a_damaged_snapshot_falls_back_by_name_and_the_run_ends_exactly_once(tmp_path, caplog, damage):
    """Before: np.load's bare 'EOF: reading array header' or '[Errno 2]', and no resume."""
    lengths = small_lengths(scale=4)
    models = [Model("m0")]
    core = make_core(tmp_path, lengths=lengths)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=1)
    for steps in (2, 4):                      # two snapshots: the latest and the one to fall back to
        sim.run(until=lambda s: s.core.num_steps >= steps)
        assert core.maybe_snapshot(force=True)
        core.store.wait_for_snapshot()
    sim.run(until=lambda s: s.core.num_steps >= 6)
    core.journal.close()
    core.close()
    latest, older = snapshot_dirs(tmp_path)
    target = latest / (array_file("commit_step", 0) if damage.startswith("array") else "state.json")
    if damage == "array byte":
        flip(target, target.stat().st_size - 3)
    elif damage == "array cut":
        target.write_bytes(target.read_bytes()[:54])
    elif damage == "state missing":
        target.unlink()
    else:
        flip(target, 20)
    with caplog.at_level(logging.WARNING, logger="hsd.recovery"):
        recovered = recover(tmp_path)
    assert recovered.snapshot_path == older
    assert f"ledger snapshot {latest} is damaged ({target}:" in caplog.text
    assert f"resuming from ledger snapshot {older} and the journal after it, not from the damaged {target}" in caplog.text
    finish(tmp_path, lengths, models)


def test_with_every_snapshot_damaged_the_journal_is_replayed_from_its_first_segment(tmp_path, caplog):
    lengths, models = started_run(tmp_path, steps=6, snapshot_at=3)
    (snap,) = snapshot_dirs(tmp_path)
    flip(snap / array_file("commit_model", 0), 100)
    with caplog.at_level(logging.WARNING, logger="hsd.recovery"):
        assert recover(tmp_path).snapshot is None
    assert "replaying the journal from its first segment" in caplog.text
    finish(tmp_path, lengths, models)


def test_a_damaged_snapshot_without_the_segments_a_fallback_needs_is_refused_by_name(tmp_path):
    started_run(tmp_path, steps=6, snapshot_at=3)
    (snap,) = snapshot_dirs(tmp_path)
    (snap / "state.json").write_text("{")
    (tmp_path / "journal-000000.jsonl").unlink()
    with pytest.raises(SnapshotDamaged, match=r"state\.json: does not parse .*journal-000000\.jsonl is gone\)"):
        recover(tmp_path)


# -- a full disk ----------------------------------------------------------------------------------
def test_a_full_disk_mid_write_fails_closed_and_the_half_line_is_the_torn_tail(tmp_path, monkeypatch):
    """Before: close() wrote the buffered lines again and raised out of the server's cleanup."""
    monkeypatch.setenv(faults.ENV, "disk_full_at=journal:1")
    journal = Journal(tmp_path)
    journal.record(EpochStarted(epoch=0, jobs=4), durable=True)
    journal.record(JobReady(job=1, w="t"))
    with pytest.raises(JournalFailed, match=r"writing the journal .*journal\.jsonl failed: No space left on device "
                                            r"\(injected by HSD_TEST_FAULTS\) \(.* free on its filesystem\)"):
        journal.record(StepCommitted(model="m", step=1, jobs=[1], w="d"), durable=True)
    journal.close()                          # never raises, writes nothing more
    assert journal.failed is not None and journal.synced_seq == 1
    monkeypatch.delenv(faults.ENV)
    assert not (tmp_path / JOURNAL_NAME).read_bytes().endswith(b"\n")
    Journal(tmp_path).close()                # the half line is cut on open
    kinds = [type(e) for e in read_journal(tmp_path)]
    assert kinds[0] is EpochStarted and StepCommitted not in kinds  # the unacknowledged commit is not there


def test_a_full_disk_at_the_snapshot_stops_the_core_with_the_path(tmp_path, monkeypatch):
    """Before: a bare RuntimeError out of the serve loop (exit 1, no fail-closed line)."""
    monkeypatch.setenv(faults.ENV, "disk_full_at=snapshot:0")
    lengths, models = small_lengths(scale=4), [Model("m0")]
    core = make_core(tmp_path, lengths=lengths)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=1)
    sim.run(until=lambda s: s.core.num_steps >= 2)
    assert core.maybe_snapshot(force=True)
    core.store.wait_for_snapshot()
    from common.run.durable import StorageFailed
    with pytest.raises(StorageFailed, match=r"writing the ledger snapshot .*state\.json failed: No space left"):
        core.maybe_snapshot(force=True)
    assert not [p for p in (tmp_path / "snapshots").iterdir() if p.name.startswith(".tmp")]  # nothing half-written
    core.journal.close()
    core.close()
    monkeypatch.delenv(faults.ENV)
    finish(tmp_path, lengths, models)


# -- snapshots written by earlier versions ---------------------------------------------------------
def old_snapshot_doc(snap):
    """``state.json`` as the untyped writer built it: the state as a dict, its manifest and checksum."""
    doc = json.loads((snap / "state.json").read_text())
    state, files = doc["state"], doc["files"]
    return state, files, {"format": 2, "state": state, "files": files,
                          "crc32": zlib.crc32(json.dumps({"state": state, "files": files}, sort_keys=True).encode())}


def test_a_snapshot_keeps_the_bytes_the_untyped_writer_wrote_and_resumes(tmp_path):
    lengths, models = started_run(tmp_path, steps=6, snapshot_at=3)
    (snap,) = snapshot_dirs(tmp_path)
    state, _, doc = old_snapshot_doc(snap)
    assert (snap / "state.json").read_text() == json.dumps(doc)
    assert set(state) == {"segment", "num_starts", "epochs_started", "models"}
    assert set(state["models"]["m0"]) == {"index", "step", "checkpoint", "last_commit"}
    assert recover(tmp_path).snapshot_path == snap
    finish(tmp_path, lengths, models)


def test_a_snapshot_written_before_manifests_is_read_unchecked_and_resumes(tmp_path):
    lengths, models = started_run(tmp_path, steps=6, snapshot_at=3)
    (snap,) = snapshot_dirs(tmp_path)
    state, _, _ = old_snapshot_doc(snap)
    (snap / "state.json").write_text(json.dumps(state))  # the state alone: no format, files or checksum
    recovered = recover(tmp_path)
    assert recovered.snapshot_path == snap and recovered.snapshot.segment == state["segment"]
    assert recovered.snapshot.models["m0"].step == state["models"]["m0"]["step"]
    finish(tmp_path, lengths, models)
