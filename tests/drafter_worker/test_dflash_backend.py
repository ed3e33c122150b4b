"""The DFlash drafter backend: checkpoint round trip, exported drafter, gradient sync, step count."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from common.run.capture_contract import contract_from_config
from common.run.checkpoint_manifest import write_manifest
from common.dataplane.slots import SlotBatch, SlotHeader
from common.run.servable import weights_files
from common.run.witness import latest_checkpoint, servable_dir, training_dir
from dflash_run import tiny_run
from dflash_testing import LAYER_IDS, backend_config, random_batch
from host_reads import HostReads
from drafter_worker.dflash.export import load_drafter
from drafter_worker.dflash_backend import DFlashBackend
from drafter_worker.factory import trainer_backend
from drafter_worker.drafter_backend import derive_schedule_jobs
from hsd.cli import main as cli_main
from worker_jobs import held_job, registration


def _jobs(target_model, count: int):
    """``count`` (job, SlotBatch) pairs as a drafter reads them out of slots."""
    out = []
    for job_id in range(count):
        hs, ids, mask, lens = random_batch(target_model, batch=2, seq_len=24, seed=100 + job_id)
        header = SlotHeader(generation=1, job_id=job_id, bucket=0, batch_size=2, seq_len=24,
                            num_tokens=int(lens.sum()))
        batch = SlotBatch(hs, ids.to(torch.int32), mask.to(torch.uint8), lens.to(torch.int32), header)
        out.append((held_job(job_id), batch))
    return out


def _train(backend, jobs, steps: range, accum: int = 2) -> list[float]:
    losses = []
    for step in steps:
        window = jobs[step * accum:(step + 1) * accum]
        for job, batch in window:
            backend.micro_batch(job, batch)
        losses.append(backend.apply_step([job.job_id for job, _ in window])["loss"])
    return losses


def test_checkpoint_then_load_latest_continues_identically(tiny_target, tiny_target_model, tmp_path):
    config = backend_config(tiny_target, tmp_path / "run")
    jobs = _jobs(tiny_target_model, 12)
    straight = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=12)
    assert straight.contract == contract_from_config(config)  # what the target sends too
    reference = _train(straight, jobs, range(6))

    first = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=12)
    assert first.load_latest(config.run_dir) == 0
    assert _train(first, jobs, range(3)) == reference[:3]
    first.save_checkpoint(config.run_dir)
    first.micro_batch(*jobs[6])  # a step in progress when the worker stops: it is not in the checkpoint
    resumed = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=12)
    assert resumed.load_latest(config.run_dir) == 3
    assert list(resumed.trained) == list(range(6))
    assert _train(resumed, jobs, range(3, 6)) == reference[3:]
    assert list(resumed.trained) == list(range(12))
    for name, tensor in straight.trainer.model.draft_state_dict().items():
        assert torch.equal(tensor, resumed.trainer.model.draft_state_dict()[name]), name


def test_a_snapshot_written_after_later_steps_holds_its_own_step(tiny_target, tiny_target_model, tmp_path):
    """A checkpoint is written on a thread while training goes on: what it writes is the state at
    its snapshot, whatever the steps trained meanwhile changed in place (weights, AdamW moments)."""
    config = backend_config(tiny_target, tmp_path / "run")
    jobs = _jobs(tiny_target_model, 8)
    straight = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=16)
    _train(straight, jobs, range(2))
    snapshot = straight.snapshot_checkpoint()
    at_step_2 = {k: v.clone() for k, v in straight.trainer.model.draft_state_dict().items()}
    later = _train(straight, jobs, range(2, 4))  # before the snapshot is written
    snapshot.write(config.run_dir)
    resumed = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=16)
    assert resumed.load_latest(config.run_dir) == 2
    for name, tensor in resumed.trainer.model.draft_state_dict().items():
        assert torch.equal(tensor, at_step_2[name]), name
    assert _train(resumed, jobs, range(2, 4)) == later


def test_load_latest_without_checkpoint_starts_afresh(tiny_target, tiny_target_model, tmp_path):
    config = backend_config(tiny_target, tmp_path / "run")
    jobs = _jobs(tiny_target_model, 4)
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=8)
    first = _train(backend, jobs, range(2))
    assert backend.load_latest(config.run_dir) == 0  # e.g. the dispatcher refused a model ahead of it
    assert backend.step == 0 and len(backend.trained) == 0
    assert _train(backend, jobs, range(2)) == first


def test_checkpoint_holds_a_servable_drafter_and_hsd_export_copies_it(tiny_target, tiny_target_model, tmp_path):
    """The servable part of a step directory, and what ``hsd export`` writes, hold config.json and
    one weights file (nothing else a serving engine would load) and reload with identical logits;
    the training state lives beside them."""
    config = backend_config(tiny_target, tmp_path / "run")
    jobs = _jobs(tiny_target_model, 4)
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=8)
    _train(backend, jobs, range(2))
    backend.save_checkpoint(config.run_dir)
    checkpoint = latest_checkpoint(config.run_dir, "drafter-0")
    servable = servable_dir(checkpoint)
    assert sorted(p.name for p in servable.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in training_dir(checkpoint).iterdir()) == ["state.json", "state.safetensors"]
    out = tmp_path / "served"
    assert cli_main(["export", "--run-dir", str(config.run_dir), "--out", str(out)]) == 2  # no text for the mask id
    assert cli_main(["export", "--run-dir", str(config.run_dir), "--out", str(out), "--mask-token", "<|MASK|>"]) == 0
    assert weights_files(servable) == [servable / "model.safetensors"]
    assert weights_files(out) == [out / "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    doc = json.loads((out / "config.json").read_text())
    assert doc["architectures"] == ["DFlashDraftModel"] and doc["block_size"] == 4
    assert doc["dflash_config"]["target_layer_ids"] == LAYER_IDS
    assert doc["dflash_config"]["mask_token"] == "<|MASK|>"   # as --mask-token named it
    # RoPE at the top level (SGLang's DFlash model reads rope_theta there) and where transformers 5 keeps it.
    assert doc["rope_theta"] == 10000.0 and doc["rope_scaling"] is None
    assert doc["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert doc["hsd_training"]["capture_point"] == "layer_output"
    # An engine serving as another user reads both files, in the run and in the copy, whatever the umask.
    for directory in (servable, out):
        assert {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir()} == \
            {"config.json": 0o644, "model.safetensors": 0o644}
    assert not any(name.startswith(("embed", "lm_head")) for name in load_file(out / "model.safetensors"))
    _, batch = jobs[0]
    anchors = torch.tensor([[5, 9, 14], [4, 10, -1]])
    model = backend.trainer.model.eval()
    with torch.no_grad():
        expected = model.logits(model(batch.hs, batch.input_ids.long(), anchors))
        for path in (out, checkpoint.path):  # hsd eval --drafter takes a step directory too
            loaded = load_drafter(path, tiny_target)
            got = loaded.logits(loaded(batch.hs, batch.input_ids.long(), anchors))
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_checkpoint_trained_at_another_capture_point_is_refused(tiny_target, tiny_target_model, tmp_path):
    """A checkpoint from before the capture point was recorded (its last layer was the final norm's
    output) never resumes a run of the current capture: the drafter stops naming both points."""
    config = backend_config(tiny_target, tmp_path / "run")
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=8)
    _train(backend, _jobs(tiny_target_model, 2), range(1))
    backend.save_checkpoint(config.run_dir)
    config_path = servable_dir(latest_checkpoint(config.run_dir, "drafter-0")) / "config.json"
    doc = json.loads(config_path.read_text())
    del doc["hsd_training"]["capture_point"]
    config_path.write_text(json.dumps(doc))
    write_manifest(latest_checkpoint(config.run_dir, "drafter-0").path)  # as written then: whole, not damaged
    with pytest.raises(ValueError, match=r"trained on target states taken at 'hidden_states', this run captures at "
                                         r"'layer_output'.*train it again in a new run directory"):
        trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=8).load_latest(config.run_dir)


def test_sync_gradients_sums_over_ranks(tiny_target, tiny_target_model, tmp_path):
    """Two identical ranks: the summed gradients over the summed weight equal one rank's step."""
    config = backend_config(tiny_target, tmp_path / "run")
    jobs = _jobs(tiny_target_model, 2)
    single = trainer_backend(config, "a", backend_class=DFlashBackend, schedule_jobs=8)
    pair = trainer_backend(config, "b", backend_class=DFlashBackend, schedule_jobs=8)
    for backend in (single, pair):
        for job, batch in jobs:
            backend.micro_batch(job, batch)
    assert float(single.sync_gradients()) == single.local_weight_total > 0  # one rank: nothing changes
    total = pair.sync_gradients(lambda t: t.mul_(2))  # the sum over two ranks holding the same
    assert float(total) == pytest.approx(2 * single.local_weight_total)
    single_loss = single.apply_step([0, 1])["loss"]
    assert pair.apply_step([0, 1], total_weight=total)["loss"] == pytest.approx(single_loss)  # the group's loss
    for name, tensor in single.trainer.model.draft_state_dict().items():
        torch.testing.assert_close(pair.trainer.model.draft_state_dict()[name], tensor)


def test_schedule_length_from_the_dispatchers_count_of_an_epoch(tmp_path):
    """Every job of every epoch, as the dispatcher counts an epoch's (its register reply's
    jobs_per_epoch: tests/dispatcher/test_core.py checks it is every epoch's schedule), or
    dflash.total_steps steps; the optimizer's schedule is never built before the count is known."""
    config = tiny_run(tmp_path, tmp_path / "run", num_samples=32, epochs=3, extra=("drafter.accum_steps=3",))
    def schedule_jobs(config, **known):
        return derive_schedule_jobs(config.dflash, config.drafter, epochs=config.run.epochs, **known)
    assert schedule_jobs(config) is None  # the dispatcher's to count
    assert schedule_jobs(config, jobs_per_epoch=11) == 11 * config.run.epochs
    fixed = tiny_run(tmp_path, tmp_path / "run", num_samples=32, epochs=3,
                     extra=("drafter.accum_steps=3", "dflash.total_steps=17"))
    assert schedule_jobs(fixed) == schedule_jobs(fixed, jobs_per_epoch=11) == 17 * 3
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend)
    with pytest.raises(RuntimeError, match="register reply"):
        backend.apply_step([])
    backend.adopt_registration(registration(jobs_per_epoch=11))
    assert backend.schedule_jobs == backend.trainer.config.total_steps == 11 * 3
    backend.adopt_registration(registration(jobs_per_epoch=5))  # a later registration changes nothing
    assert backend.trainer.config.total_steps == 11 * 3
    known = trainer_backend(fixed, "drafter-1", backend_class=DFlashBackend)
    assert known.trainer.config.total_steps == 17 * 3  # known without a reply


def test_the_learning_rate_follows_the_jobs_trained_whatever_the_world_size(tiny_target, tmp_path):
    """One group steps 4 jobs at a time (4 ranks), another 2 (2 ranks), a third changes its world
    size between steps: once the same jobs are trained, their next step takes the same learning rate."""
    config = backend_config(tiny_target, tmp_path / "run", "dflash.warmup_ratio=0.25")
    lrs = {}
    for name, sizes in (("four", [4, 4, 4, 4]), ("two", [2] * 8), ("elastic", [1, 3, 2, 2, 4, 4])):
        backend = trainer_backend(config, name, backend_class=DFlashBackend, schedule_jobs=16)
        done, seen = 0, {}
        for size in sizes:
            done += size
            backend.apply_step(list(range(done - size, done)))
            seen[done] = backend.trainer.optimizer.param_groups[0]["lr"]  # what the next step applies
        lrs[name] = seen
    for jobs in (4, 8, 12, 16):
        assert lrs["four"][jobs] == lrs["two"][jobs]
    assert lrs["elastic"][8] == lrs["four"][8] and lrs["elastic"][16] == lrs["four"][16]
    assert len({lrs["four"][jobs] for jobs in (4, 8, 12, 16)}) == 4  # warmup, then cosine: it moved every time


def test_an_optimizer_step_reads_the_host_once(tiny_target, tiny_target_model, tmp_path):
    """Two micro-batches and the step, as the drafter loop calls them: the only read is the step's
    figures at its end (for the log line and the commit). On a GPU every read waits for the queued
    work, so more would keep the next slot's copy from overlapping compute."""
    config = backend_config(tiny_target, tmp_path / "run", "dflash.log_every=1")
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=8)
    jobs = _jobs(tiny_target_model, 2)
    with HostReads() as reads:  # the first step: the optimizer's state is created in it too
        for job, batch in jobs:
            backend.micro_batch(job, batch)
        metrics = backend.apply_step([0, 1])
    assert reads.names == ["tolist"], reads.names
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0

    with HostReads() as control:  # what the count is made of is seen: a read, a selection by a mask
        loss = torch.tensor([1.0, -2.0])
        float(loss[loss > 0].sum())
    assert control.names == ["__getitem__[mask]", "__float__"], control.names
