"""`hsd launch` with a real target and a real DFlash drafter: exactly once, and an exact resume.

One slot and one target make the job order the schedule's own, so two runs train on the same
batches in the same steps; with fixed seeds their loss trajectories must then be equal, also when
one of them is killed while it writes a checkpoint (its files on disk, not yet published) and is
launched again: it resumes from the checkpoint before, which is still ``latest``.
"""

from __future__ import annotations

import re

import pytest

from safetensors.torch import load_file

from common import faults
from common.wire.client import run_id_for
from common.dataplane.shm_arena import list_segments
from common.run.servable import weights_files
from common.run.witness import latest_checkpoint, servable_dir
from dflash_run import tiny_run_args
from hsd_testing import hsd, report

STEP_LINE = re.compile(r"drafter-0 step\s+(\d+)\s+loss (\S+)")
DURABLE_LINE = re.compile(r"checkpoint of step (\d+) durable")
SEQUENTIAL = ("pool.slots=1", "pool.min_ready=0", "pool.target_credits=1", "run.epochs=2")


def _losses(log_text: str) -> dict[int, str]:
    """Step -> loss as logged; a step trained again after a resume keeps its last value."""
    return {int(step): loss for step, loss in STEP_LINE.findall(log_text)}


def _steps_before_durable(log_text: str) -> set[int]:
    """Checkpoint steps M whose next step's loss line comes before the line saying M is durable."""
    trained: set[int] = set()
    found = set()
    for line in log_text.splitlines():
        if step := STEP_LINE.search(line):
            trained.add(int(step.group(1)))
        elif durable := DURABLE_LINE.search(line):
            if int(durable.group(1)) + 1 in trained:
                found.add(int(durable.group(1)))
    return found


def _final_weights(run_dir):
    servable = servable_dir(latest_checkpoint(run_dir, "drafter-0"))
    assert weights_files(servable) == [servable / "model.safetensors"]  # nothing else an engine would load
    return load_file(servable / "model.safetensors")


@pytest.mark.timeout(900)  # three launches, each starting torch in three processes: slow on a loaded 2-core host
def test_real_run_exactly_once_and_resumed_run_trains_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    args = tiny_run_args(tmp_path, straight_dir, num_samples=24, extra=SEQUENTIAL)
    monkeypatch.setenv(faults.ENV, "checkpoint_delay_s=2")  # a slow disk: every checkpoint takes 2 s to publish
    proc = hsd("launch", *args, timeout=400)
    monkeypatch.delenv(faults.ENV)
    assert "run complete: every epoch committed" in proc.stderr
    r = report(straight_dir)
    assert r["finished"] and (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
    assert (r["witness_duplicates"], r["witness_missing"]) == (0, 0)
    log_text = (straight_dir / "logs" / "drafter-0.log").read_text()
    reference = _losses(log_text)
    assert sorted(reference) == list(range(1, len(reference) + 1)) and len(reference) >= 8
    # Training went on while a checkpoint was written: the step after it ends before it is durable.
    assert _steps_before_durable(log_text) & {2, 4, 6, 8}, "no step completed while a checkpoint was written"

    # The same run, its drafter killed while it writes the checkpoint of step 6 (on the writer's
    # thread, training going on), then launched again: step 4's checkpoint is still the latest.
    args = tiny_run_args(tmp_path, resumed_dir, num_samples=24, extra=(*SEQUENTIAL, "drafter.max_restarts=0"))
    monkeypatch.setenv(faults.ENV, "checkpoint_exit_at_step=6")
    first = hsd("launch", *args, timeout=400, check=False)
    assert first.returncode != 0 and "no drafter is left" in first.stderr
    assert latest_checkpoint(resumed_dir, "drafter-0").step == 4
    model_dir = latest_checkpoint(resumed_dir, "drafter-0").path.parent
    assert [p.name.rsplit("-", 1)[0] for p in model_dir.glob(".tmp-*")] == [".tmp-step-00000006"]  # killed mid-write
    assert not (model_dir / "step-00000006").exists()
    monkeypatch.delenv(faults.ENV)
    proc = hsd("launch", *args, timeout=400)
    assert "resumes from its checkpoint at step 4" in proc.stdout
    assert not list(model_dir.glob(".tmp-*"))  # the next checkpoint removed what the killed writer left
    r = report(resumed_dir)
    assert r["finished"] and (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
    assert (r["witness_duplicates"], r["witness_missing"]) == (0, 0)
    assert _losses((resumed_dir / "logs" / "drafter-0.log").read_text()) == reference
    straight, resumed = _final_weights(straight_dir), _final_weights(resumed_dir)
    assert straight.keys() == resumed.keys()
    assert all(straight[name].equal(resumed[name]) for name in straight)
    exported = tmp_path / "served"
    # the tiny target's tokenizer names no text for the mask id (its last row): the serving one would
    hsd("export", "--run-dir", str(resumed_dir), "--out", str(exported), "--mask-token", "<|MASK|>")
    assert weights_files(exported) == [exported / "model.safetensors"]
    assert load_file(exported / "model.safetensors").keys() == straight.keys()
    for path in (straight_dir, resumed_dir):
        assert not list_segments(run_id_for(path)), "shared memory left behind"
