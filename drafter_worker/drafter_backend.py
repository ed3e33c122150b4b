"""A drafter trainer behind the worker loop: what the DFlash and EAGLE-3 backends share.

Each checkpoint is one step directory (:func:`common.run.witness.save_checkpoint`) holding the
exported drafter in its servable part (:func:`common.run.witness.servable_dir`: ``config.json`` +
``model.safetensors`` in the drafter's published layout, which ``hsd eval --drafter`` and serving
engines load as is), the training state in its training part (:func:`common.run.witness.training_dir`:
``state.safetensors`` + ``state.json``: optimizer, scheduler, step, the trainer's own RNGs, the
process RNGs of the CPU and, on a GPU, of the device), and the trained-jobs witness. Resuming from
it continues the run exactly as if it had not stopped.

Gradients of a step accumulate unnormalised over its micro-batches (see
:class:`drafter_worker.recipe.AccumulatingTrainer`); :meth:`TrainerBackend.sync_gradients` is where
a data-parallel group sums them, the weight total and the loss and accuracy sums over its ranks
before the step is applied.

A drafter names what is its own: its config section, trainer, servable config, and what it does
before a micro-batch or at start (:class:`drafter_worker.dflash_backend.DFlashBackend`,
:class:`drafter_worker.eagle3_backend.Eagle3Backend`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from common import faults
from common.run.capture_contract import LEGACY_CAPTURE_POINT, capture_point_hint, contract_of
from common.run.config import ConfigError, DataSection, DrafterSection, RunSection, TargetSection, TrainingRecipe
from common.dataplane.host_staging import HostStaging
from common.dataplane.slots import SlotBatch
from common.wire import messages
from common.run.witness import (CheckpointSnapshot, TrainedJobs, check_model_id, newest_usable, servable_dir,
                            training_dir)
from drafter_worker.step_metrics import StepClock, TensorBoardLog, format_metrics, step_metrics
from drafter_worker.layers import CONFIG_NAME, write_drafter_files
from drafter_worker.process_group import AllReduce, all_reduce_flat
from drafter_worker.state_io import flatten_state, load_state, write_state
from drafter_worker.state_transfer import weights_checksum, witness_from_tensor, witness_tensor

# Test-only fault: the process dies right after applying this step, between a commit and the next
# checkpoint, so a test can show that a resumed run trains exactly as an uninterrupted one.


def derive_schedule_jobs(training: TrainingRecipe, drafter: DrafterSection, *, epochs: int,
                         jobs_per_epoch: int | None = None) -> int | None:
    """The learning-rate schedule's length in jobs trained (it advances by every step's job count,
    so its position follows what was trained whatever the world size of a group did):
    ``training.total_steps`` steps of ``accum_steps x drafter.count`` jobs; or every job of every
    one of ``epochs`` (``run.epochs``), shared among ``drafter.count`` independent drafters. An
    epoch's jobs are the dispatcher's count (the ``register`` reply's ``jobs_per_epoch``): None while
    it is not known."""
    num_drafters = max(1, drafter.count)
    if training.total_steps:
        return training.total_steps * drafter.accum_steps * num_drafters
    if jobs_per_epoch is None:
        return None
    num_jobs = jobs_per_epoch * epochs
    return max(1, math.ceil(num_jobs / (1 if drafter.grouped else num_drafters)))


def default_device(drafter: DrafterSection) -> torch.device:
    # hsd launch gives each worker one GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 in the worker.
    if drafter.gpus and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


class TrainerBackend:
    """A :class:`common.worker.backends.DrafterBackend` around a
    :class:`drafter_worker.recipe.AccumulatingTrainer`. A subclass sets the class attributes below
    and may override the hooks (``_resolve_section``, ``_trainer_extras``, ``_seed_job``,
    ``_servable_config``).

    It takes the sections it reads: ``training``, the drafter's own section (``section``: dflash or
    eagle3), and the run's ``target``, ``drafter``, ``run`` and ``data`` sections
    (:func:`drafter_worker.factory.trainer_backend` hands a config's over)."""

    section: str  # the config section of the drafter's keys (the one passed as ``training``)
    train_config_class: Any  # its trainer's config: ``from_section(section, total_steps=...)``
    trainer_class: Any  # the trainer, built on ``(train_config, target_dir, layer_ids, device, seed, **extras)``
    export_config: Any  # staticmethod: the servable config.json of a model config and dtype
    target_use: str  # why it needs target.model (the error when it is not set)
    log: logging.Logger  # its step lines' logger
    verifies_slots = False  # trains on what it reads, checks none of it

    def __init__(self, model_id: str, *, training: TrainingRecipe, target: TargetSection, drafter: DrafterSection,
                 run: RunSection, data: DataSection, device: str | torch.device | None = None,
                 schedule_jobs: int | None = None):
        if not target.model:
            raise ConfigError(f"target.model: {self.target_use}; set the target model directory")
        self.training, self.drafter, self.data = training, drafter, data
        self.epochs = run.epochs
        self.run_dir = Path(run.dir)
        self.model_id = check_model_id(model_id)
        contract = contract_of(target, drafter.objective)  # what the target derives too: the dispatcher compares them
        self.contract = contract
        self.layer_ids = list(contract.layer_ids)
        self.target = target
        self.target_dir = str(target.model)
        self.device = torch.device(device) if device is not None else default_device(drafter)
        self.seed = run.seed
        section = self._resolve_section(training)
        # Known now when given or set by <section>.total_steps; else the first register reply brings
        # the epoch's job count (adopt_registration), before the optimizer and its schedule are built.
        self.schedule_jobs = schedule_jobs or derive_schedule_jobs(training, drafter, epochs=self.epochs)
        self.train_config = self.train_config_class.from_section(section, total_steps=self.schedule_jobs or 1)
        self.train_config.validate()
        self.keep = drafter.checkpoint_keep
        self.export_dtype = section.export_dtype
        self.log_every = section.log_every
        self.trainer = self._new_trainer()
        self.staging = HostStaging()  # a checkpoint's host copies, reused from one checkpoint to the next
        self.step = 0
        self.trained = TrainedJobs()
        self.window: list[int] = []
        self.clock = StepClock()
        self.last_metrics: dict[str, float] = {}
        self.tensorboard = TensorBoardLog(self.run_dir, self.model_id)
        self._synced_total: torch.Tensor | None = None  # the group's weight total, once sync_gradients ran

    # -- what a drafter names ----------------------------------------------------------------
    def _resolve_section(self, section):
        """The drafter's config section as it trains (a value chosen at start filled in)."""
        return section

    def _trainer_extras(self) -> dict[str, Any]:
        """Keyword arguments of the trainer beyond the ones every trainer takes."""
        return {}

    def _seed_job(self, job_id: int) -> None:
        """Before a job's micro-batch: seed what it draws at random from the job alone."""

    def _servable_config(self, dtype: str) -> dict:
        """The checkpoint's servable ``config.json``: the export's, with the run's capture point."""
        doc = self.export_config(self.trainer.model.config, dtype)
        doc.setdefault("hsd_training", {})["capture_point"] = self.contract.capture_point
        return doc

    def _new_trainer(self):
        # The process RNG is seeded too: whatever draws from it (a kernel, a library) repeats on a rerun.
        torch.manual_seed(self.seed)
        return self.trainer_class(self.train_config, target_dir=self.target_dir, layer_ids=self.layer_ids,
                                  device=self.device, seed=self.seed, **self._trainer_extras())

    # -- the schedule's length, from the dispatcher ------------------------------------------
    def adopt_registration(self, reply: messages.RegisterReply) -> None:
        """Take what a ``register`` reply says about training: the jobs of an epoch, which set the
        learning-rate schedule's length unless it was given or set by ``<section>.total_steps``."""
        if self.schedule_jobs is not None:
            return
        if reply.jobs_per_epoch is None:
            raise RuntimeError(f"{self.model_id}: the dispatcher's register reply has no jobs_per_epoch; the "
                               f"learning-rate schedule needs it (or set {self.section}.total_steps)")
        self.schedule_jobs = derive_schedule_jobs(self.training, self.drafter, epochs=self.epochs,
                                                  jobs_per_epoch=reply.jobs_per_epoch)
        self.train_config.total_steps = self.schedule_jobs
        self.train_config.validate()

    def _check_schedule(self) -> None:
        """The optimizer builds its schedule on first use: never on a length not known yet."""
        if self.schedule_jobs is None:
            raise RuntimeError(f"{self.model_id}: the learning-rate schedule's length is not known before the "
                               f"dispatcher's register reply (adopt_registration)")

    # -- checkpoints ------------------------------------------------------------------------
    def load_latest(self, run_dir: str | os.PathLike) -> int:
        # the newest whole checkpoint (an older one when it is damaged), read before anything changes
        usable = newest_usable(run_dir, self.model_id,
                               lambda checkpoint: (load_state(training_dir(checkpoint)), checkpoint.trained_jobs()))
        if usable is None:
            if self.step or self.window:  # the model moved on from its initial state: start it afresh
                self.trainer = self._new_trainer()
            self.step, self.trained = 0, TrainedJobs()
        else:
            checkpoint, (state, trained) = usable.checkpoint, usable.read
            self._check_capture_point(checkpoint.path)
            self.trainer.load_state_dict(state["trainer"])
            self._restore_rngs(state)
            self.step, self.trained = checkpoint.step, trained
            if self.trainer.step != self.step:
                raise ValueError(f"checkpoint {checkpoint.path}: training state at step {self.trainer.step}, "
                                 f"witness at step {self.step}")
        self.window = []
        self.clock = StepClock()
        return self.step

    def _rng_states(self) -> dict[str, torch.Tensor]:
        """The random generators a step draws from (anchors, dropout): the CPU's, and on a GPU the
        device's, so a resumed or joining rank draws what the uninterrupted one would have."""
        states = {"torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return states

    def _restore_rngs(self, state: dict) -> None:
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:  # a checkpoint written on a CPU has none
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

    def _check_capture_point(self, step_dir) -> None:
        """A checkpoint trained on states taken elsewhere than this run's capture point is refused."""
        config_path = servable_dir(step_dir) / CONFIG_NAME
        doc = json.loads(config_path.read_text()) if config_path.is_file() else {}
        theirs = (doc.get("hsd_training") or {}).get("capture_point", LEGACY_CAPTURE_POINT)
        ours = self.contract.capture_point
        if theirs != ours:
            raise ValueError(f"checkpoint {step_dir} was trained on target states taken at {theirs!r}, this run "
                             f"captures at {ours!r}: {capture_point_hint(ours, theirs)}")

    # -- a joiner's state, from a live rank (drafter_worker/state_transfer.py) ---------------------
    def live_state(self) -> dict:
        """Everything a rank holds between steps: weights, optimizer, scheduler, RNGs, witness."""
        self._check_schedule()
        return {"trainer": self.trainer.state_dict(), **self._rng_states(), "step": self.step,
                "trained": witness_tensor(self.trained)}

    def load_live_state(self, state: dict) -> None:
        self.trainer.load_state_dict(state["trainer"])
        self._restore_rngs(state)
        self.step, self.trained = int(state["step"]), witness_from_tensor(state["trained"])
        self.window, self.clock, self._synced_total = [], StepClock(), None

    def weights_checksum(self) -> int:
        return weights_checksum(self.trainer.model.draft_state_dict())

    def _export_dtype(self) -> str:
        if self.export_dtype != "auto":
            return self.export_dtype
        return str(self.trainer.compute_dtype).removeprefix("torch.")

    def snapshot_checkpoint(self) -> CheckpointSnapshot:
        """The checkpoint at this step, on host copies of the state (pinned buffers on a GPU): a
        thread can write it while training goes on."""
        self._check_schedule()
        tensors: dict[str, torch.Tensor] = {}
        structure = flatten_state({"trainer": self.trainer.state_dict(), **self._rng_states()}, tensors,
                                  host=False)
        draft = {f"servable/{name}": t for name, t in self.trainer.model.draft_state_dict().items()}
        host = self.staging.copy({**tensors, **draft})
        draft_tensors = {name.removeprefix("servable/"): host[name] for name in draft}
        training_tensors = {name: host[name] for name in tensors}
        dtype = self._export_dtype()
        config_doc = self._servable_config(dtype)
        return CheckpointSnapshot(
            self.model_id, self.step, self.trained.copy(), keep_last=self.keep,
            write_servable=lambda directory: write_drafter_files(draft_tensors, config_doc, directory, dtype=dtype),
            write_training=lambda directory: write_state(structure, training_tensors, directory))

    def save_checkpoint(self, run_dir: str | os.PathLike) -> None:
        self.snapshot_checkpoint().write(run_dir)

    # -- a step -----------------------------------------------------------------------------
    def micro_batch(self, job: messages.Job, batch: SlotBatch) -> None:
        started = time.perf_counter()
        self._seed_job(job.job_id)
        self.trainer.micro_batch(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens)
        self.window.append(job.job_id)
        # The token count from the slot's header, not from the lengths tensor: that may be on the device.
        self.clock.add_compute(time.perf_counter() - started, batch.header.num_tokens)

    @property
    def local_weight_total(self) -> float:
        """Total position weight of this rank's micro-batches of the step (what the group sums)."""
        return self.trainer.local_weight_total

    def sync_gradients(self, all_reduce: AllReduce | None = None) -> torch.Tensor:
        """Sum the step's gradients, weight total, loss sum and accuracy counts over a data-parallel
        group; return the group's weight total, a tensor on the device (reading it waits for the sums).

        ``all_reduce`` sums a tensor in place across the ranks; None (one rank) changes nothing.
        :meth:`apply_step` then divides by the group's total and reports the group's loss.
        """
        if all_reduce is None:
            self._synced_total = None
            return self.trainer.step_sums()[0]
        for p in self.trainer.params:
            if p.grad is None:  # a rank with nothing supervised still takes part in every sum
                p.grad = torch.zeros_like(p)
        sums = self.trainer.step_sums()
        all_reduce_flat([p.grad for p in self.trainer.params] + [sums], all_reduce)
        self._synced_total = self.trainer.adopt_group_sums(sums)
        return self._synced_total

    def apply_step(self, job_ids: list[int], *, total_weight: float | torch.Tensor | None = None) -> dict:
        """``job_ids``: every job of the step (a data-parallel group's: every rank's); the weights saw them all."""
        assert set(self.window) <= set(job_ids), f"committed {job_ids}, trained on {self.window}"
        self._check_schedule()
        if total_weight is None:
            total_weight = self._synced_total
        self._synced_total = None
        started = time.perf_counter()
        stats = self.trainer.apply_step(total_weight=total_weight, num_jobs=len(job_ids))
        self.trained.add(job_ids)
        self.step += 1
        self.window = []
        self.clock.add_compute(time.perf_counter() - started)
        wall_s, compute_s, num_tokens = self.clock.finish()
        self.last_metrics = step_metrics(stats, wall_s=wall_s, compute_s=compute_s, num_tokens=num_tokens)
        if self.step % self.log_every == 0:
            self.log.info("%s", format_metrics(self.model_id, self.step, self.last_metrics))
        self.tensorboard.write(self.step, self.last_metrics)
        faults.exit_after_step(self.step, self.log, self.model_id)
        return self.last_metrics

    def drop_step(self) -> None:
        self._synced_total = None
        self.trainer.drop_step()
        self.window = []
        self.clock.drop()

    def close(self) -> None:
        self.tensorboard.close()
