"""A simulated drafter: verifies every byte it reads, models the training cost, keeps a real witness.

Its model state is exactly its trained-jobs witness (:class:`common.run.witness.TrainedJobs`): an
applied step appends the step's job ids, a checkpoint saves them, a restart loads them back. The
run report judges exactly-once from these records alone. Any byte that differs from the pattern
the sim target wrote fails the worker loudly.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

from common import faults
from common.run.config import DrafterSection
from common.dataplane.slot_pattern import verify_against_dataset, verify_pattern
from common.dataplane.slots import SlotBatch
from common.wire import messages
from common.run.witness import CheckpointSnapshot, TrainedJobs, check_model_id, newest_usable


class WitnessModel:
    """A drafter model whose state is its trained-jobs witness alone: it computes nowhere
    (``device`` None), holds no gradients to sum and no figures, and its checkpoint is the witness.
    What a :class:`common.worker.backends.DrafterBackend` needs beyond training, for the sim drafter
    and the benchmarks' drafters."""

    contract = None
    device = None
    verifies_slots = False

    def __init__(self, model_id: str, *, keep: int = 3):
        self.model_id = model_id
        self.step = 0
        self.trained = TrainedJobs()
        self.keep = keep
        self.last_metrics: dict[str, float] = {}

    def adopt_registration(self, reply: messages.RegisterReply) -> None:
        """No learning-rate schedule to size."""

    def sync_gradients(self, all_reduce: Any) -> float:
        """No gradients: nothing to sum."""
        return 0.0

    def snapshot_checkpoint(self) -> CheckpointSnapshot:
        return CheckpointSnapshot(self.model_id, self.step, self.trained.copy(), keep_last=self.keep)

    def save_checkpoint(self, run_dir: str | os.PathLike) -> None:
        self.snapshot_checkpoint().write(run_dir)

    def live_state(self) -> dict:
        return {"step": self.step, "trained": list(self.trained)}

    def load_live_state(self, state: dict) -> None:
        self.step, self.trained = int(state["step"]), TrainedJobs(int(i) for i in state["trained"])

    def weights_checksum(self) -> int:
        """CRC32 of the witness: the whole state there is."""
        return zlib.crc32(self.trained.to_bytes())

    def close(self) -> None:
        """Nothing was opened."""


class SimDrafter(WitnessModel):
    verifies_slots = True  # every micro-batch is checked byte for byte (commit_step's ``verified``)

    def __init__(self, drafter: DrafterSection, model_id: str, *, dataset_path: str | None):
        """``dataset_path``: the prepared dataset a real target reads, to check the slots against (None
        behind a sim target: the slots then hold the sim target's pattern)."""
        super().__init__(check_model_id(model_id), keep=drafter.checkpoint_keep)
        self.cost_per_token = drafter.sim_cost_per_token
        # DFlash trains a fixed number of anchor blocks per sequence: its cost follows the sequence
        # count far more than the length.
        self.cost_per_sequence = drafter.sim_cost_per_sequence
        self._window: list[int] = []
        # test-only faults planted in the witness (common.faults), so a test can show the report catches them
        self._duplicate, self._drop = faults.witness_faults()
        # Behind a real target the slots hold a model's states, not a pattern: check them against the
        # prepared dataset the target read instead.
        self._dataset = None
        if dataset_path:
            from common.run.prepared import PreparedDataset
            self._dataset = PreparedDataset(dataset_path)

    def load_latest(self, run_dir: str | os.PathLike) -> int:
        usable = newest_usable(run_dir, self.model_id, lambda checkpoint: checkpoint.trained_jobs())
        self.trained = usable.read if usable is not None else TrainedJobs()
        self.step = usable.checkpoint.step if usable is not None else 0
        self._window = []
        return self.step

    def micro_batch(self, job: messages.Job, batch: SlotBatch) -> None:
        if self._dataset is not None:
            verify_against_dataset(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=job.job_id,
                                   samples=job.samples, dataset=self._dataset)
        else:
            verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=job.job_id,
                           expected_seq_lens=job.lengths)
        time.sleep(self.cost_per_token * job.num_tokens + self.cost_per_sequence * len(job.samples))
        self._window.append(job.job_id)

    def apply_step(self, job_ids: list[int]) -> dict:
        assert job_ids == self._window, f"committed {job_ids}, trained on {self._window}"
        self.trained.add(j for j in job_ids if j != self._drop)
        self.trained.add(j for j in job_ids if j == self._duplicate)
        self.step += 1
        self._window = []
        return {"micro_batches": len(job_ids)}

    def drop_step(self) -> None:
        self._window = []
