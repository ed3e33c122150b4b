"""common/run/records/events.py: every kind of event survives the journal, whole or with its defaults."""

import json
import math
import zlib

import msgspec
import pytest

from common.run.records.events import (EVENT_TYPES, KINDS, Checkpointed, DispatcherStarted, DispatcherStopped,
                                       EpochCommitted, EpochStarted, JobConsumed, JobGivenBack, JobReady,
                                       MembershipOpened, ModelRolledBack, StepCommitted, WorkerJoined, WorkerLeft)
from common.run.records.journal import JOURNAL_NAME, decode_event, encode_event, intact_body, read_journal
from dispatcher.journal import Journal

# one of each kind with every field away from its default, so each field is written and read back
FULL = [
    DispatcherStarted(t=1.5, resumed=True, committed=7),
    DispatcherStopped(t=2.0, done=True, peak_slots=10, slot_bytes=5_287_936),
    WorkerJoined(t=3.25, w="t0.1", role="target", name="target-0", pid=8003, host="vm", node="node-a", queue=1),
    WorkerLeft(t=4.0, w="t0.1", reason="lease_expired"),
    MembershipOpened(t=5.0, model="m", version=3, step=12, ranks=["d0.1", "d1.1"], transfer=True),
    EpochStarted(t=6.0, epoch=1, jobs=109, buckets=[1, 1, 3, 6, 15, 83]),
    EpochCommitted(t=7.0, epoch=1),
    JobReady(t=8.123456, job=1_000_000_004, w="t0.1", tokens=6719, busy_s=0.778192),
    JobConsumed(t=9.0, job=1_000_000_004, w="d0.1", bucket=5, remote=1),
    JobGivenBack(t=10.0, job=1_000_000_004, was="extracting", reason="target_failed: out of memory \u00e9", w="t0.1"),
    StepCommitted(t=11.0, model="m", step=13, jobs=[1_000_000_004, 1_000_000_001], w="d0.1", buckets=[3, 5],
                  avail=2, mixed=False, tokens=22667, busy_s=0.080139, verified=2,
                  metrics={"step": 12.0, "loss": 2.5, "tokens_per_s": 1234.5}, membership=3, sync_wait_s=0.01,
                  step_s=0.2, rank_jobs=[1, 1], rank_busy_s=[0.04, 0.05]),
    ModelRolledBack(t=12.0, model="m", step=4, jobs=6, cause="restart"),
    Checkpointed(t=13.0, model="m", step=13, w="d0.1", via="register", metrics={"step": 13.0, "loss": 2.25}),
]
# the same kinds with only what has no default
BARE = [
    DispatcherStarted(t=1.0), DispatcherStopped(t=1.0), WorkerJoined(t=1.0, w="t0.0", role="target"),
    WorkerLeft(t=1.0, w="t0.0"), MembershipOpened(t=1.0, model="m", version=0, step=0),
    EpochStarted(t=1.0, epoch=0, jobs=3), EpochCommitted(t=1.0, epoch=0), JobReady(t=1.0, job=0, w="t0.0"),
    JobConsumed(t=1.0, job=0, w="d0.0", bucket=0), JobGivenBack(t=1.0, job=0, was="training", reason="left"),
    StepCommitted(t=1.0, model="m", step=1, jobs=[0]), ModelRolledBack(t=1.0, model="m", step=0),
    Checkpointed(t=1.0, model="m", step=1),
]


def away_from_default(event):
    """The names of the event's fields (its time aside) whose value is not the field's default."""
    def default(field):
        return field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
    return {f.name for f in msgspec.structs.fields(event) if f.name != "t" and getattr(event, f.name) != default(f)}


def test_every_kind_of_the_journal_has_a_struct():
    assert sorted(KINDS) == sorted(["start", "stop", "join", "leave", "epoch", "epoch_committed", "ready", "consumed",
                                    "give_back", "commit", "rollback", "checkpoint", "membership"])
    assert [type(e) for e in FULL] == [type(e) for e in BARE] == list(EVENT_TYPES)
    for event in FULL:  # the samples set every field, so the round trip below covers each of them
        assert away_from_default(event) == {f.name for f in msgspec.structs.fields(event)} - {"t"}, event


@pytest.mark.parametrize("events", [FULL, BARE], ids=["every_field", "defaults"])
def test_every_kind_round_trips_through_the_journal(tmp_path, events):
    journal = Journal(tmp_path)
    for event in events:
        journal.record(msgspec.structs.replace(event), durable=True)
    journal.close()
    assert list(read_journal(tmp_path)) == events
    for cls, event in zip(EVENT_TYPES, events):
        assert list(read_journal(tmp_path, only=(cls,))) == [event]
        line = encode_event(event)
        assert decode_event(intact_body(line)) == event
        doc = json.loads(line[9:])  # the kind, then the time, then the fields set away from their defaults
        assert list(doc)[:2] == ["ev", "t"] and doc["ev"] == cls.__struct_config__.tag
        assert set(doc) - {"ev", "t"} == away_from_default(event)


def test_the_time_is_stamped_unless_given(tmp_path):
    journal = Journal(tmp_path)
    journal.record(EpochCommitted(epoch=0))
    journal.record(EpochCommitted(epoch=1, t=5.0))
    journal.close()
    stamped, given = read_journal(tmp_path)
    assert stamped.t > 1.6e9 and stamped.t == round(stamped.t, 6) and given.t == 5.0


def test_a_figure_that_is_not_a_number_is_read_back_as_none(tmp_path):
    """msgspec writes NaN as null; a journal of json.dumps wrote it as the bare NaN, read back as NaN."""
    journal = Journal(tmp_path)
    journal.record(StepCommitted(model="m", step=1, jobs=[0], metrics={"step": 0, "loss": math.nan}), durable=True)
    journal.close()
    body = json.dumps({"ev": "checkpoint", "t": 2.0, "model": "m", "step": 1, "w": "d0.0",
                       "metrics": {"step": 1, "loss": math.nan, "tokens_per_s": math.inf}}, separators=(",", ":"))
    assert "NaN" in body
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b"%08x %s\n" % (zlib.crc32(body.encode()), body.encode()))
    new, old = read_journal(tmp_path)
    assert new.metrics == {"step": 0.0, "loss": None}
    assert old.step == 1 and math.isnan(old.metrics["loss"]) and old.metrics["tokens_per_s"] == math.inf
