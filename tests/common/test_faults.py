"""common/faults.py: the one test-fault switch, its syntax and errors, and the points that read it."""

import pytest

from common import faults
from common.faults import FaultSpecError, KillAt


def test_entries_parse_to_typed_values_and_kill_at_repeats():
    parsed = faults.parse("kill_at=drafter-0@committed:3, kill_at=drafter-1@backward:4,checkpoint_delay_s=0.5,"
                          "log_weight_checksums,target_stop_in_job=/tmp/held.json,journal_fsync_fails_after=0")
    assert parsed == {"kill_at": (KillAt("drafter-0", "committed", 3), KillAt("drafter-1", "backward", 4)),
                      "checkpoint_delay_s": 0.5, "log_weight_checksums": True,
                      "target_stop_in_job": "/tmp/held.json", "journal_fsync_fails_after": 0}
    assert faults.parse("") == {}


@pytest.mark.parametrize("text, says", [
    ("kil_at=d0@committed:3", "unknown fault 'kil_at' in 'kil_at=d0@committed:3'"),
    ("kill_at=d0@nowhere:3", "'kill_at=d0@nowhere:3': bad value for kill_at (the point is one of"),
    ("kill_at=d0@committed", "the form is <drafter name>@<point>:<step>"),
    ("checkpoint_exit_at_step=0", "'checkpoint_exit_at_step=0': bad value for checkpoint_exit_at_step"),
    ("checkpoint_delay_s=soon", "bad value for checkpoint_delay_s"),
    ("checkpoint_delay_s", "checkpoint_delay_s takes a value"),
    ("log_weight_checksums=1", "log_weight_checksums is a flag"),
    ("witness_drop=3,witness_drop=4", "'witness_drop=4': witness_drop is given twice"),
])
def test_a_bad_entry_is_named(text, says):
    with pytest.raises(FaultSpecError, match="^HSD_TEST_FAULTS: ") as info:
        faults.parse(text)
    assert says in str(info.value)


def test_every_fault_says_what_it_does():
    assert all(fault.what for fault in faults.FAULTS.values())


def test_unset_switch_means_no_fault(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.active() == {}
    assert faults.checkpoint_before_publish() is None
    assert not faults.kills_armed() and not faults.log_weight_checksums()
    assert faults.journal_fsyncs_allowed() is None and faults.witness_faults() == (None, None)


def test_the_switch_is_read_again_when_it_changes(monkeypatch):
    monkeypatch.setenv(faults.ENV, "witness_duplicate=7")
    assert faults.witness_faults() == (7, None)
    monkeypatch.setenv(faults.ENV, "witness_drop=9")
    assert faults.witness_faults() == (None, 9)


def test_kill_at_fires_once_per_run_directory_at_its_step_or_later(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "kill_at=drafter-0@committed:3")
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    faults.kill_at("drafter-0", "committed", step=2, run_dir=tmp_path)
    faults.kill_at("drafter-1", "committed", step=3, run_dir=tmp_path)
    faults.kill_at("drafter-0", "allreduce", step=3, run_dir=tmp_path)
    assert killed == [] and faults.kills_armed()
    faults.kill_at("drafter-0", "committed", step=4, run_dir=tmp_path)
    faults.kill_at("drafter-0", "committed", step=5, run_dir=tmp_path)  # its restart: the marker says it fired
    assert killed == [faults.signal.SIGKILL]


def test_exit_before_commit_reply_from_its_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "dispatcher_exit_before_commit_reply=3")
    assert [faults.exit_before_commit_reply(tmp_path, step) for step in (1, 2, 3, 4)] == [False, False, True, False]
