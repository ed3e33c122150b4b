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
from typing import Any, Protocol

from common.dataplane.slots import SlotBatch, SlotView
from common.run.capture_contract import CaptureContract
from common.run.witness import CheckpointSnapshot
from common.wire.messages import Job


class PendingSlotWrite(Protocol):
    """A slot whose data is still being copied on ``stream``; :meth:`wait` completes it."""

    stream: Any  # the torch.cuda.Stream the copies run on

    def wait(self) -> None:
        """Block until the copies have landed, then publish the header (generation last)."""


class TargetBackend(Protocol):
    contract: CaptureContract | None  # capture contract sent at registration (None for sim)

    def extract(self, job: Job, slot: SlotView) -> PendingSlotWrite | None:
        """Fill the slot for ``job``: data, then the header with the generation last. None when the slot
        is complete on return; else the write still in flight, which the loop completes before reporting."""


class DrafterBackend(Protocol):
    """A backend may also take what each register reply says (``adopt_registration(reply)`` with the
    RegisterReply, optional: a trainer's learning-rate schedule spans the reply's ``jobs_per_epoch``)."""

    model_id: str
    contract: CaptureContract | None
    step: int  # optimizer steps applied (the model's state)

    def load_latest(self, run_dir: str | os.PathLike) -> int:
        """Load the latest checkpoint; return its step (0 = none)."""

    def micro_batch(self, job: Job, batch: SlotBatch) -> None:
        """Compute on one micro-batch (``batch`` is the reader's copy, valid until the next read)."""

    def apply_step(self, job_ids: list[int]) -> dict:
        """The commit was acknowledged: apply, ``step += 1``, witness += ``job_ids``; return step metrics."""

    def drop_step(self) -> None:
        """The step was refused or lost: discard what :meth:`micro_batch` accumulated."""

    def snapshot_checkpoint(self) -> CheckpointSnapshot:
        """The checkpoint at ``self.step`` on copies of the state, for a thread to write while
        training goes on (:mod:`common.run.checkpoint_writer`). A backend without it is checkpointed
        on the training thread through :meth:`save_checkpoint`."""

    def save_checkpoint(self, run_dir: str | os.PathLike) -> None:
        """Weights + witness at ``self.step`` (:func:`common.run.witness.save_checkpoint`), written now."""


class GroupDrafterBackend(DrafterBackend, Protocol):
    """A drafter backend that trains as a rank of an elastic data-parallel group."""

    def sync_gradients(self, all_reduce) -> float:
        """Sum the step's gradients (and whatever weighs them) over the group; the group's weight total."""

    def live_state(self) -> dict:
        """The whole training state (weights, optimizer, scheduler, RNG, ``step``, and ``trained``:
        the witness as an int64 tensor), as nested dicts of tensors and plain values: a joiner's state."""

    def load_live_state(self, state: dict) -> None:
        """Take a live rank's :meth:`live_state` as this rank's own."""

    def weights_checksum(self) -> int:
        """CRC32 of the weights (:func:`drafter_worker.state_transfer.weights_checksum`)."""
