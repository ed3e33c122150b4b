"""A drafter's checkpoints: snapshot on the training thread, written on the writer's, reported once durable.

One part of the drafter loop (:class:`drafter_worker.loop.DrafterLoop`), given what it uses. Every
``drafter.checkpoint_every`` steps, and when the dispatcher says nothing more is coming while
steps are not yet checkpointed, the backend snapshots its state (host copies) and a thread writes
it while training goes on (:mod:`common.run.checkpoint_writer`, at most one in flight: the next waits
for it); once it is durable the loop sends ``checkpoint {model, step}`` — with the figures of that
step (``metrics``: loss, lr, ...) when this process applied it, so the last step's figures reach the
journal too. The process exits only once its last write is on disk, and reloads a checkpoint only
with no write in flight. In a group rank 0 writes; the other ranks note the step as saved.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from common.run.checkpoint_writer import CheckpointWriteFailed, CheckpointWriter
from common.run.config import DispatcherSection
from common.wire import messages
from common.wire.messages import ProtocolError
from common.run.witness import Checkpoint, NoUsableCheckpoint
from common.worker.backends import DrafterBackend
from common.worker.gpu_health import ReportingSession
from common.worker.runtime import DispatcherGone, WorkerLost, WorkerUnusable
from drafter_worker.step_group import DrafterState

log = logging.getLogger("hsd.drafter")


class Checkpoints:
    """A drafter's checkpoint bookkeeping: ``backend``'s model, written by ``writer`` under ``run_dir``
    and reported on ``session``; the step checkpointed goes in ``state``; ``dispatcher``: that
    section's timeouts, which say when a stop saves nothing."""

    def __init__(self, *, name: str, run_dir: str | os.PathLike, backend: DrafterBackend, session: ReportingSession,
                 writer: CheckpointWriter, state: DrafterState, dispatcher: DispatcherSection):
        self.name, self.run_dir, self.backend, self.session = name, run_dir, backend, session
        self.writer, self.state, self.dispatcher = writer, state, dispatcher
        self.unreported: Checkpoint | None = None  # durable, not yet acknowledged by the dispatcher
        self.durable_step = 0  # the step of the newest checkpoint this process loaded or wrote (register says it)
        self._figures: tuple[int, dict[str, float]] | None = None  # the latest applied step's figures
        self._saved_figures: dict[str, Any] | None = None  # those of the checkpoint being written

    # -- the figures of a step --------------------------------------------------------------------
    def note_figures(self) -> None:
        """After a step is applied: its figures (the backend's ``last_metrics``; a sim has none)."""
        metrics = self.backend.last_metrics
        if metrics:
            self._figures = (self.backend.step, {k: v for k, v in metrics.items() if math.isfinite(v)})

    def figures_of(self, step: int) -> dict[str, Any] | None:
        """``metrics`` of a commit_step or checkpoint: the figures of ``step``, named with it, when this
        process applied that step (after a reload or a state transfer it may hold another one)."""
        if self._figures is None or self._figures[0] != step:
            return None
        return {"step": step, **self._figures[1]}

    # -- checkpoints ----------------------------------------------------------------------------
    def _checkpoint(self, *, best_effort: bool = False) -> None:
        """Start the checkpoint of the applied step: snapshot now, written on the writer's thread.
        The dispatcher hears of it once it is durable (:meth:`report_durable`)."""
        self.wait_for_writer()  # at most one in flight: the previous one is written first
        self.report_durable(best_effort=best_effort)
        self._saved_figures = self.figures_of(self.backend.step)
        self.writer.start(self.backend.snapshot_checkpoint())
        self.state.checkpointed_step = self.backend.step

    def save_applied(self, rank: int, *, all_leave: bool = False) -> None:
        """Checkpoint the applied step: rank 0 writes (every rank holds the same weights), the others
        note the step as saved. ``all_leave``: the group (or the lone drafter) stops; its last
        checkpoint is on disk, and said if the dispatcher listens, before it goes."""
        if rank != 0:
            self.state.checkpointed_step = self.backend.step
        elif all_leave:
            self.finish()
        else:
            self._checkpoint()

    def wait_for_writer(self, *, quiet: bool = False) -> None:
        """Block until no checkpoint is being written (``quiet``: a failed write is logged, not raised)."""
        try:
            self._durable(self.writer.wait())
        except CheckpointWriteFailed:
            if not quiet:
                raise
            log.exception("%s: the last checkpoint was not written", self.name)

    def report_durable(self, *, best_effort: bool = False) -> None:
        """Send ``checkpoint {model, step}`` for a checkpoint that became durable (the witness rule:
        never before its files are on disk)."""
        self._durable(self.writer.poll())
        if self.unreported is None:
            return
        step = self.unreported.step
        saved = self._saved_figures
        request = messages.Checkpoint(model=self.backend.model_id, step=step,
                                      metrics=saved if saved is not None and saved["step"] == step else None)
        try:
            if best_effort:
                self.session.call(request)
            else:
                self.session.call_until_answered(request)
        except (ProtocolError, WorkerLost, DispatcherGone) as exc:
            if not best_effort:
                raise  # unreported stays: it is sent again once the drafter has registered again
            log.warning("%s: checkpoint at step %d saved, but not acknowledged: %s", self.name, step, exc)
            return
        self.unreported = None
        log.info("%s: checkpoint of model %s at step %d", self.name, self.backend.model_id, step)

    def _durable(self, checkpoint: Checkpoint | None) -> None:
        """A checkpoint that became durable: to be reported (and said at the next register)."""
        if checkpoint is not None:
            self.unreported = checkpoint
            self.durable_step = max(self.durable_step, checkpoint.step)

    def reload(self) -> None:
        """Go back to the latest checkpoint, once the one being written (if any) is published."""
        self.wait_for_writer()
        self.state.pending = None  # the state it belonged to is gone
        self.load_latest()

    def load_latest(self) -> None:
        """Load the model's newest whole checkpoint (an older one when the newest is damaged: the
        dispatcher rolls the model back to its step when it registers). None whole: this drafter
        cannot train the model, and a restart would not change that: it exits "unusable"."""
        try:
            self.state.checkpointed_step = self.durable_step = self.backend.load_latest(self.run_dir)
        except NoUsableCheckpoint as exc:
            raise WorkerUnusable(f"{self.name}: {exc}") from None

    def finish(self) -> None:
        """On a stop: checkpoint what was applied, wait for it to be written, tell the dispatcher if it
        listens. Not when the dispatcher went unheard for as long as it takes to give up on a model
        (``dispatcher.abandoned_model_s`` after ``worker_timeout_s``: a drafter paused or cut off that
        long): it may have taken this model back to its checkpoint and
        given the later steps' jobs to other drafters, and a save of those steps would train them
        twice by the witness. A dispatcher that did not roll it back does so from the checkpoint on
        disk: the steps are trained again, once."""
        silent_s = self.session.channel.silent_for_s()
        # the dispatcher gives a model up no sooner than worker_timeout_s (this drafter declared dead)
        # plus the grace after the last heartbeat it answered; half the timeout is the margin
        dispatcher = self.dispatcher
        bound_s = dispatcher.abandoned_after_s + 0.5 * dispatcher.worker_timeout_s
        if self.backend.step > self.state.checkpointed_step and silent_s >= bound_s:
            log.warning("%s: step %d not saved: the dispatcher went unheard for %.0fs, long enough to have taken "
                        "model %s back to its checkpoint at step %d (dispatcher.abandoned_model_s %.0fs after "
                        "worker_timeout_s)", self.name, self.backend.step, silent_s, self.backend.model_id,
                        self.state.checkpointed_step, dispatcher.abandoned_after_s)
        elif self.backend.step > self.state.checkpointed_step:
            self._checkpoint(best_effort=True)
        self.wait_for_writer()
        self.report_durable(best_effort=True)
