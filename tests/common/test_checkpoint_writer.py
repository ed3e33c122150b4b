"""The background checkpoint writer: one write in flight, handed out once durable, failures raised
on the training thread, a failed write leaving the previous checkpoint as latest."""

from __future__ import annotations

import threading

import pytest

from common.run.checkpoint_writer import CheckpointWriteFailed, CheckpointWriter
from common.run.durable import StorageFailed
from common.run.witness import CheckpointSnapshot, TrainedJobs, latest_checkpoint


def _snapshot(step: int, write_training=None) -> CheckpointSnapshot:
    return CheckpointSnapshot("m", step, TrainedJobs(range(step)), write_training=write_training)


def test_a_checkpoint_is_handed_out_once_when_durable(tmp_path):
    writer = CheckpointWriter(tmp_path, name="d")
    gate = threading.Event()
    writer.before_publish = lambda tmp, step: gate.wait(10)
    writer.start(_snapshot(1))
    assert writer.in_flight_step == 1 and writer.poll() is None and latest_checkpoint(tmp_path, "m") is None
    with pytest.raises(AssertionError, match="one checkpoint in flight"):
        writer.start(_snapshot(2))
    gate.set()
    durable = writer.wait()
    assert durable.step == 1 and latest_checkpoint(tmp_path, "m").step == 1
    assert writer.poll() is None and writer.wait() is None and writer.in_flight_step is None


def test_a_failed_write_is_raised_by_wait_and_keeps_the_previous_latest(tmp_path):
    writer = CheckpointWriter(tmp_path, name="d")
    writer.start(_snapshot(1))
    writer.wait()

    def full_disk(directory):
        raise OSError(28, "No space left on device", str(directory))
    writer.start(_snapshot(2, write_training=full_disk))
    # a full disk is the fail-closed stop (hsd exits 3), one line with the path and the free space
    with pytest.raises(StorageFailed, match=r"d: writing the checkpoint of step 2 at .*tmp-step-00000002.* failed: "
                                            r"No space left on device \(.* free on its filesystem\)"):
        writer.wait()
    assert latest_checkpoint(tmp_path, "m").step == 1
    assert not [p for p in (tmp_path / "models" / "m").iterdir() if p.name.startswith(".tmp")]

    def broken(directory):
        raise ValueError("a bug")
    writer.start(_snapshot(2, write_training=broken))
    with pytest.raises(CheckpointWriteFailed, match="checkpoint of step 2 failed: a bug"):
        writer.wait()
    assert latest_checkpoint(tmp_path, "m").step == 1
    writer.start(_snapshot(2))  # the writer is usable again
    assert writer.wait().step == 2
