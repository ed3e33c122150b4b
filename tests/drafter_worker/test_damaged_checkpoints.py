"""A damaged checkpoint found on resume: the drafter falls back to the older one kept on disk, in one
line naming the file, or, with none whole, refuses (exit "unusable", naming the files) and is not
restarted into the same failure. A checkpoint written before manifests still loads."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from common.run.checkpoint_manifest import MANIFEST_FILE, DamagedCheckpoint, check_manifest
from common.run.config import load_config
from common.run.witness import (STEP_FILE, NoUsableCheckpoint, TrainedJobs, latest_checkpoint, model_dir,
                                save_checkpoint, training_dir)
from common.worker.runtime import EXIT_UNUSABLE
from drafter_worker.linear_backend import WEIGHTS_FILE, LinearDrafter

torch.set_num_threads(1)


def linear(step: int = 0) -> LinearDrafter:
    config = load_config(None, ["target.hidden_size=8", "target.num_capture_layers=2", "run.seed=7"])
    drafter = LinearDrafter("m", drafter=config.drafter, target=config.target, seed=config.run.seed)
    drafter.step = step
    return drafter


def checkpoints_at(run_dir, steps) -> dict[int, torch.Tensor]:
    """A LinearDrafter checkpointed at each of ``steps`` (its weights moved and its witness grown
    each time): each step's weights."""
    drafter, weights = linear(), {}
    for step in steps:
        with torch.no_grad():
            drafter.weight.add_(1.0)
        drafter.step = step
        drafter.trained.add(range(drafter.step * 10, drafter.step * 10 + 2))
        drafter.save_checkpoint(run_dir)
        weights[step] = drafter.weight.detach().clone()
    return weights


def flip_byte(path, offset=None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def truncate_half(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_checkpoint_lists_every_file_with_its_size_and_checksum_last(tmp_path):
    checkpoints_at(tmp_path, [1])
    step_dir = latest_checkpoint(tmp_path, "m").path
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {"trained_jobs.bin", STEP_FILE, f"training/{WEIGHTS_FILE}"}
    weights = training_dir(step_dir) / WEIGHTS_FILE
    assert manifest["files"][f"training/{WEIGHTS_FILE}"]["size"] == weights.stat().st_size
    assert check_manifest(step_dir, has_manifest=True) is True


@pytest.mark.parametrize("damage", [flip_byte, truncate_half], ids=["flipped byte", "cut in half"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one_in_one_line_naming_the_file(tmp_path, caplog,
                                                                                           damage):
    weights = checkpoints_at(tmp_path, [4, 8, 12])
    damaged = training_dir(latest_checkpoint(tmp_path, "m")) / WEIGHTS_FILE
    damage(damaged)
    resumed = linear()
    with caplog.at_level(logging.INFO):
        assert resumed.load_latest(tmp_path) == 8
    assert torch.equal(resumed.weight.detach(), weights[8])
    assert list(resumed.trained) == [40, 41, 80, 81]
    (line,) = damage_lines(caplog)
    assert str(damaged) in line and "step 8" in line, line
    assert ("changed" if damage is flip_byte else "cut short") in line, line


def test_a_flipped_byte_in_the_witness_or_the_step_file_is_found_too(tmp_path, caplog):
    checkpoints_at(tmp_path, [4, 8, 12])
    newest = latest_checkpoint(tmp_path, "m").path
    flip_byte(newest / "trained_jobs.bin", offset=3)
    with caplog.at_level(logging.WARNING):
        assert linear().load_latest(tmp_path) == 8
    assert str(newest / "trained_jobs.bin") in damage_lines(caplog)[0]
    older = model_dir(tmp_path, "m") / "step-00000008"
    flip_byte(older / STEP_FILE, offset=2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert linear().load_latest(tmp_path) == 4
    assert any(str(older / STEP_FILE) in line for line in damage_lines(caplog))


def test_with_every_checkpoint_damaged_the_drafter_refuses_naming_each_file_and_what_to_do(tmp_path):
    checkpoints_at(tmp_path, [4, 8])
    root = model_dir(tmp_path, "m")
    for step_dir in ("step-00000004", "step-00000008"):
        truncate_half(root / step_dir / "training" / WEIGHTS_FILE)
    with pytest.raises(NoUsableCheckpoint) as refused:
        linear().load_latest(tmp_path)
    message = str(refused.value)
    for step_dir in ("step-00000004", "step-00000008"):
        assert str(root / step_dir / "training" / WEIGHTS_FILE) in message
    assert "cut short" in message and f"move {root} aside" in message


def test_a_drafter_with_no_usable_checkpoint_exits_unusable_without_a_traceback(tmp_path):
    """`hsd launch` restarts a worker that fails, but not one that exits "unusable": no crash loop."""
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, "drafter-x", 3, TrainedJobs([1, 2, 3]))
    flip_byte(latest_checkpoint(run_dir, "drafter-x").path / "trained_jobs.bin", offset=0)
    proc = subprocess.run([sys.executable, "-m", "hsd.cli", "drafter", "--sim", "--name", "drafter-x",
                           f"run.dir={run_dir}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_UNUSABLE, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "no usable checkpoint" in proc.stderr and "trained_jobs.bin" in proc.stderr, proc.stderr[-3000:]


def test_a_checkpoint_without_a_manifest_loads_as_before_and_is_verified_by_loading(tmp_path, caplog):
    weights = checkpoints_at(tmp_path, [4, 8])
    root = model_dir(tmp_path, "m")
    for step_dir in ("step-00000004", "step-00000008"):   # as written before checkpoints had a manifest
        (root / step_dir / MANIFEST_FILE).unlink()
        meta = json.loads((root / step_dir / STEP_FILE).read_text())
        del meta["manifest"]
        (root / step_dir / STEP_FILE).write_text(json.dumps(meta))
    with caplog.at_level(logging.INFO):
        resumed = linear()
        assert resumed.load_latest(tmp_path) == 8
    assert torch.equal(resumed.weight.detach(), weights[8])
    assert any("has no manifest" in r.getMessage() for r in caplog.records)
    assert not damage_lines(caplog)
    truncate_half(root / "step-00000008" / "training" / WEIGHTS_FILE)   # loading it is what finds this
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert linear().load_latest(tmp_path) == 4
    (line,) = damage_lines(caplog)
    assert str(root / "step-00000008" / "training" / WEIGHTS_FILE) in line and "unreadable" in line, line


def test_a_lost_manifest_is_damage_when_the_step_file_says_there_was_one(tmp_path):
    checkpoints_at(tmp_path, [4])
    step_dir = latest_checkpoint(tmp_path, "m").path
    (step_dir / MANIFEST_FILE).unlink()
    with pytest.raises(DamagedCheckpoint, match="missing"):
        check_manifest(step_dir, has_manifest=True)


@pytest.mark.parametrize("changed", ["trained_jobs.bin", '"size"'])
def test_a_changed_byte_in_the_manifest_is_the_manifests_damage(tmp_path, changed):
    """A file name or a key changed in the listing: the manifest is named, not a file it never listed
    (hsd bench corruption found 'trainedWjobs.bin: missing')."""
    checkpoints_at(tmp_path, [4])
    step_dir = latest_checkpoint(tmp_path, "m").path
    manifest = step_dir / MANIFEST_FILE
    flip_byte(manifest, manifest.read_bytes().index(changed.encode()) + 3)
    with pytest.raises(DamagedCheckpoint) as damaged:
        check_manifest(step_dir, has_manifest=True)
    assert damaged.value.path == manifest


def test_a_damaged_latest_file_falls_back_to_the_step_directories(tmp_path, caplog):
    checkpoints_at(tmp_path, [4, 8])
    (model_dir(tmp_path, "m") / "latest").write_text("step-0000\x008\n")
    with caplog.at_level(logging.WARNING):
        assert linear().load_latest(tmp_path) == 8
    assert "latest" in damage_lines(caplog)[0]


def test_the_next_checkpoint_after_a_fallback_replaces_the_damaged_history(tmp_path):
    """Resumed from step 8 past a damaged step 12, the model's next checkpoints are its history: the
    damaged directory goes once one is written, and is never counted among the ones kept."""
    checkpoints_at(tmp_path, [4, 8, 12])
    truncate_half(training_dir(latest_checkpoint(tmp_path, "m")) / WEIGHTS_FILE)
    drafter = linear()
    assert drafter.load_latest(tmp_path) == 8
    drafter.step = 10
    drafter.save_checkpoint(tmp_path)
    root = model_dir(tmp_path, "m")
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == \
        ["step-00000004", "step-00000008", "step-00000010"]
    assert linear().load_latest(tmp_path) == 10


def test_the_report_refuses_to_judge_a_damaged_final_witness_and_names_the_file(tmp_path):
    from ops.report import witness
    save_checkpoint(tmp_path, "m", 2, TrainedJobs([0, 1]))
    assert witness(tmp_path, {0: 2})["witness_missing"] == 0
    witness_file = latest_checkpoint(tmp_path, "m").path / "trained_jobs.bin"
    flip_byte(witness_file, offset=8)                # job 1 would read as another job: never counted
    with pytest.raises(DamagedCheckpoint, match="cannot be judged") as refused:
        witness(tmp_path, {0: 2})
    assert refused.value.path == witness_file
