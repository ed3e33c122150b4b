"""A one-layer drafter on the captured states: the smallest real torch model behind the drafter loop.

It predicts, from the captured states at position ``t``, a number derived from the next token
(``(input_ids[t+1] % 16) / 16``) with a squared error, at every supervised position (``t`` and
``t+1`` both inside the sequence, ``t+1`` in the loss mask). It exists to exercise what a real
drafter needs from the worker: unnormalised gradients summed over micro-batches, a step weighted by
supervised positions across the whole step (every micro-batch of every rank of a data-parallel
group: sum the gradients and the weight, divide once), checkpoints that carry weights and the
trained-jobs witness, and a resume that loads them back. Plain SGD keeps the optimizer stateless,
so a checkpoint is exactly the weights plus the witness.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from common.run.config import DrafterSection, TargetSection
from common.dataplane.slots import SlotBatch
from common.wire import messages
from common.run.checkpoint_manifest import reading
from common.run.witness import Checkpoint, CheckpointSnapshot, TrainedJobs, check_model_id, newest_usable, training_dir
from drafter_worker.process_group import all_reduce_flat
from drafter_worker.state_transfer import weights_checksum, witness_from_tensor, witness_tensor

WEIGHTS_FILE = "linear.safetensors"
LABEL_MODULUS = 16


class LinearDrafter:
    contract = None
    device = None  # the CPU, whatever the transport: its slots are copied where their kind says
    verifies_slots = False

    def __init__(self, model_id: str, *, drafter: DrafterSection, target: TargetSection, seed: int,
                 lr: float = 0.05):
        """``seed``: the run seed (``run.seed``), which draws the initial weights."""
        self.model_id = check_model_id(model_id)
        self.keep = drafter.checkpoint_keep
        num_features = target.num_capture_layers * target.hidden_size
        generator = torch.Generator().manual_seed(seed)
        # Every rank draws the same initial weights from the run seed: the group starts in agreement.
        self.weight = torch.nn.Parameter(torch.randn(num_features, generator=generator) / num_features ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.optimizer = torch.optim.SGD([self.weight, self.bias], lr=lr)
        self._initial = self.state_dict()  # what a model without a checkpoint goes back to
        self.step = 0
        self.trained = TrainedJobs()
        # a modeled per-sequence cost on top of its own (DFlash's anchor blocks), for benchmarks
        self.cost_per_sequence = drafter.sim_cost_per_sequence
        self.local_weight_total = 0.0  # supervised positions of the micro-batches since the last step
        self.local_loss_sum = 0.0
        self._step_total: float | None = None  # the group's weight total, once gradients were all-reduced
        self._step_loss: float | None = None
        self.last_metrics: dict[str, float] = {}  # its step figures stay out of the journal (apply_step returns them)

    def adopt_registration(self, reply: messages.RegisterReply) -> None:
        """Plain SGD at a fixed rate: no schedule to size."""

    def close(self) -> None:
        """Nothing was opened."""

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight, self.bias]

    # -- training -----------------------------------------------------------------------------
    def micro_batch(self, job: messages.Job, batch: SlotBatch) -> None:
        hs_BSF = batch.hs.float()
        batch_size, seq_len = hs_BSF.shape[:2]
        positions = torch.arange(seq_len - 1)
        inside = positions[None, :] + 1 < batch.seq_lens[:, None].long()
        supervised = inside & batch.loss_mask[:, 1:].bool()
        labels = (batch.input_ids[:, 1:].long() % LABEL_MODULUS).float() / LABEL_MODULUS
        pred = hs_BSF[:, :-1] @ self.weight + self.bias
        loss_sum = ((pred - labels) ** 2 * supervised).sum()
        loss_sum.backward()  # unnormalised: the step divides once by the total weight
        self.local_weight_total += float(supervised.sum())
        self.local_loss_sum += float(loss_sum.detach())
        if self.cost_per_sequence > 0:
            time.sleep(self.cost_per_sequence * batch_size)

    def sync_gradients(self, all_reduce: Callable[[torch.Tensor], None]) -> float:
        """Sum gradients, weight and loss over the group with one ``all_reduce`` (in place, sum);
        returns the group's weight total, which :meth:`apply_step` divides by."""
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        sums = torch.tensor([self.local_weight_total, self.local_loss_sum], dtype=self.parameters[0].dtype)
        all_reduce_flat([p.grad for p in self.parameters] + [sums], all_reduce)
        self._step_total, self._step_loss = float(sums[0]), float(sums[1])
        return self._step_total

    def apply_step(self, job_ids: list[int]) -> dict:
        total = self._step_total if self._step_total is not None else self.local_weight_total
        loss_sum = self._step_loss if self._step_loss is not None else self.local_loss_sum
        if total > 0:
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.div_(total)
            self.optimizer.step()
        self.trained.add(job_ids)
        self.step += 1
        self._reset()
        return {"loss": loss_sum / total if total > 0 else 0.0, "weight": total, "micro_batches": len(job_ids)}

    def drop_step(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.local_weight_total = self.local_loss_sum = 0.0
        self._step_total = self._step_loss = None

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.detach().clone(), "bias": self.bias.detach().clone()}

    def live_state(self) -> dict:
        """Weights, step and witness (plain SGD holds no optimizer state)."""
        return {**self.state_dict(), "step": self.step, "trained": witness_tensor(self.trained)}

    def load_live_state(self, state: dict) -> None:
        self._reset()
        with torch.no_grad():
            self.weight.copy_(state["weight"])
            self.bias.copy_(state["bias"])
        self.step, self.trained = int(state["step"]), witness_from_tensor(state["trained"])

    def weights_checksum(self) -> int:
        return weights_checksum(self.state_dict())

    def snapshot_checkpoint(self) -> CheckpointSnapshot:
        weights = self.state_dict()  # copies

        def write_weights(directory: Path) -> None:
            save_file(weights, str(directory / WEIGHTS_FILE))
        # Not a servable model: its weights are training state only.
        return CheckpointSnapshot(self.model_id, self.step, self.trained.copy(), write_training=write_weights,
                                  keep_last=self.keep)

    def save_checkpoint(self, run_dir: str | os.PathLike) -> None:
        self.snapshot_checkpoint().write(run_dir)

    def load_latest(self, run_dir: str | os.PathLike) -> int:
        """Load the newest whole checkpoint (an older one when it is damaged); none: the initial weights."""
        def read(checkpoint: Checkpoint) -> tuple[dict[str, torch.Tensor], TrainedJobs]:
            path = training_dir(checkpoint) / WEIGHTS_FILE
            with reading(path):
                tensors = load_file(str(path))
                tensors = {"weight": tensors["weight"], "bias": tensors["bias"]}
            return tensors, checkpoint.trained_jobs()

        usable = newest_usable(run_dir, self.model_id, read)
        tensors, trained = usable.read if usable is not None else (self._initial, TrainedJobs())
        self._reset()
        with torch.no_grad():
            self.weight.copy_(tensors["weight"])
            self.bias.copy_(tensors["bias"])
        self.trained = trained
        self.step = usable.checkpoint.step if usable is not None else 0
        return self.step
