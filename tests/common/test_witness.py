"""Model checkpoints with the trained-jobs witness: atomic, keep-last-k, and what a killed writer left."""

import json
import subprocess

from common.run.witness import (STEP_FILE, StepRecord, TrainedJobs, latest_checkpoint, model_dir, read_step_record,
                                save_checkpoint, write_step_record)


def test_checkpoints_keep_the_last_k_and_the_latest_reloads_its_witness(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, "m", step, TrainedJobs(range(step * 2)), keep_last=2)
    latest = latest_checkpoint(tmp_path, "m")
    assert latest.step == 4 and list(latest.trained_jobs()) == list(range(8))
    assert sorted(p.name for p in model_dir(tmp_path, "m").iterdir() if p.name.startswith("step-")) == \
        ["step-00000003", "step-00000004"]


def test_a_checkpoint_removes_what_a_killed_writer_left_and_spares_a_live_one(tmp_path):
    root = model_dir(tmp_path, "m")
    root.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead_partial = root / f".tmp-step-00000007-{gone.pid}"
        live_partial = root / f".tmp-step-00000007-{live.pid}"
        for partial in (dead_partial, live_partial):
            partial.mkdir()
            (partial / "model.safetensors").write_bytes(b"half")
        save_checkpoint(tmp_path, "m", 1, TrainedJobs([1, 2]))
        assert not dead_partial.exists() and live_partial.exists()
        assert latest_checkpoint(tmp_path, "m").step == 1
    finally:
        live.kill()
        live.wait()


def test_a_step_record_written_before_model_and_manifest_were_recorded_reads(tmp_path):
    (tmp_path / STEP_FILE).write_text(json.dumps({"step": 12}))
    assert read_step_record(tmp_path) == StepRecord(step=12)
    write_step_record(tmp_path, StepRecord(model="m", step=12, num_trained=3, manifest="manifest.json"))
    assert (tmp_path / STEP_FILE).read_text() == json.dumps(
        {"model": "m", "step": 12, "num_trained": 3, "manifest": "manifest.json"})  # the bytes json.dumps wrote
