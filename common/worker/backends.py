"""What a worker computes, behind the one worker loop (:mod:`common.worker.loop`).

The loop owns the control plane, the transport, the jobs it holds and the window of a drafter's step;
a backend only computes. A target backend fills a slot for a job; a drafter backend trains on a
batch the loop has already copied out of its slot, and applies an optimizer step only once the
dispatcher has made the commit durable (commit, then apply): the model's state never runs ahead of
the journal, and the trained-jobs witness it checkpoints (:mod:`common.run.witness`) is exactly what
its weights saw.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from common.dataplane.slots import SlotBatch, SlotView
from common.run.capture_contract import CaptureContract
from common.run.witness import CheckpointSnapshot
from common.wire.messages import Job, RegisterReply


class PendingSlotWrite(Protocol):
    """A slot whose data is still being copied on ``stream``; :meth:`wait` completes it."""

    stream: Any  # the torch.cuda.Stream the copies run on

    def wait(self) -> None:
        """Block until the copies have landed, then publish the header (generation last)."""


class TargetBackend(Protocol):
    contract: CaptureContract | None  # capture contract sent at registration (None for sim)
    device: Any  # where its slots are written from (None: a sim's, which computes nothing: the transport's kind says)

    def extract(self, job: Job, slot: SlotView) -> PendingSlotWrite | None:
        """Fill the slot for ``job``: data, then the header with the generation last. None when the slot
        is complete on return; else the write still in flight, which the loop completes before reporting."""


@runtime_checkable
class DrafterBackend(Protocol):
    """What the drafter loop (:mod:`drafter_worker.loop`) asks of a model it trains, every member
    required: a lone drafter and a rank of a data-parallel group use the same ones (a model that
    holds no gradients, a sim's, sums nothing)."""

    model_id: str
    contract: CaptureContract | None
    step: int  # optimizer steps applied (the model's state)
    device: Any  # where it computes (None: nowhere, a sim's: the transport's kind says where its slots live)
    verifies_slots: bool  # every micro-batch is checked byte for byte (commit_step's ``verified``)
    last_metrics: dict[str, float]  # the figures of the step applied last (empty: none)

    def adopt_registration(self, reply: RegisterReply) -> None:
        """Take what a ``register`` reply says about training (a trainer's learning-rate schedule
        spans the reply's ``jobs_per_epoch``)."""

    def load_latest(self, run_dir: str | os.PathLike) -> int:
        """Load the latest checkpoint; return its step (0 = none)."""

    def micro_batch(self, job: Job, batch: SlotBatch) -> None:
        """Compute on one micro-batch (``batch`` is the reader's copy, valid until the next read)."""

    def sync_gradients(self, all_reduce: Any) -> Any:
        """Sum the step's gradients (and whatever weighs them) over a data-parallel group; the group's weight total."""

    def apply_step(self, job_ids: list[int]) -> dict:
        """The commit was acknowledged: apply, ``step += 1``, witness += ``job_ids``; return step metrics."""

    def drop_step(self) -> None:
        """The step was refused or lost: discard what :meth:`micro_batch` accumulated."""

    def snapshot_checkpoint(self) -> CheckpointSnapshot:
        """The checkpoint at ``self.step`` on copies of the state, for a thread to write while
        training goes on (:mod:`common.run.checkpoint_writer`)."""

    def live_state(self) -> dict:
        """The whole training state (weights, optimizer, scheduler, RNG, ``step``, and ``trained``:
        the witness as an int64 tensor), as nested dicts of tensors and plain values: a joiner's state."""

    def load_live_state(self, state: dict) -> None:
        """Take a live rank's :meth:`live_state` as this rank's own."""

    def weights_checksum(self) -> int:
        """CRC32 of the weights (:func:`drafter_worker.state_transfer.weights_checksum`)."""

    def close(self) -> None:
        """The process is done with it (logs flushed)."""
