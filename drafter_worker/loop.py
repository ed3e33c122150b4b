"""A drafter worker: accumulate a step of micro-batches, commit it, apply it once it is durable.

The handshake with the dispatcher (protocol v2), in the order the loop keeps:

- start: load the model's latest checkpoint and register with ``model: {id, step}``; the ledger
  rolls the model back to exactly that step. A model ahead of the ledger reloads its checkpoint and
  registers again.
- a step: ``get_hs`` (the next one always in flight), copy the slot out, ``consumed``, the backend's
  ``micro_batch``. On a GPU the copy of slot N+1 runs on the transport's copy stream while
  micro-batch N computes (:meth:`common.transport.DrafterTransport.start_read`): the slot is
  released once the copy's event completes, and the compute stream waits on that event, not the
  host on the compute stream. After ``accum_steps`` micro-batches (fewer when the dispatcher says ``flush``),
  ``commit_step {model, step: current + 1, job_ids}``. The next slot is copied while the commit is
  in flight; before the next micro-batch the loop waits for the answer: acknowledged → the backend
  applies the step (weights, witness); refused → the step is dropped and its jobs leave the held
  set, so the dispatcher gives them back. No answer → the same commit again (it is idempotent).
- checkpoints: every ``drafter.checkpoint_every`` steps, and when the dispatcher says nothing more
  is coming (``flush`` with an empty window, or ``done``) while steps are not yet checkpointed:
  the backend snapshots its state (host copies) and a thread writes it while training goes on
  (:mod:`common.checkpoint_writer`, at most one in flight: the next waits for it); once it is
  durable the loop sends ``checkpoint {model, step}``. The dispatcher says ``done`` only once every
  model's last commit is checkpointed; the process exits only once its last write is on disk, and
  reloads a checkpoint only with no write in flight.
- a slot rewritten before or under the copy (StaleSlotError, also when found once the copy's event
  completed): ``read_failed``, and on to the next job.
- the dispatcher restarted (unknown worker): the pending step is dropped (its jobs were given back)
  and the drafter registers again with the step it has applied.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from common.checkpoint_writer import CheckpointWriteFailed, CheckpointWriter
from common.cuda_ipc import PeerMappingError
from common.config import Config
from common.protocol import ErrorCode, ProtocolError
from common.slots import SlotBatch, StaleSlotError
from common.transport import DrafterTransport, open_drafter_transport
from common.worker_backends import DrafterBackend
from common.worker_loop import WorkerLoop
from common.witness import Checkpoint, latest_checkpoint
from common.worker_runtime import (CALL_TIMEOUT_S, RECONNECT_S, DispatcherGone, NoReply, WorkerLost, WorkerUnusable,
                                   resend_until_answered)
from drafter_worker.busy_clock import BusyClock

log = logging.getLogger("hsd.drafter")


class DrafterLoop(WorkerLoop):
    role = "drafter"

    def __init__(self, config: Config, name: str, backend: DrafterBackend, **kwargs: Any):
        super().__init__(config, name, backend, **kwargs)
        self.run_dir = config.run_dir
        self.checkpoint_every = config.drafter.checkpoint_every
        self.checkpointed_step = 0  # the step of the latest checkpoint written or being written
        self.writer = CheckpointWriter(config.run_dir, name=name)
        self.unreported: Checkpoint | None = None  # durable, not yet acknowledged by the dispatcher
        self.durable_step = 0  # the step of the newest checkpoint this process loaded or wrote (register says it)
        self.window: list[int] = []  # job ids of the step being accumulated
        self.clock = BusyClock(getattr(backend, "device", "cpu"))  # the micro-batches' compute time
        self.commit: tuple[dict[str, Any], int] | None = None  # (fields, request id) of the commit in flight
        # a commit whose dispatcher died before it answered: its gradients are kept, and the next
        # register asks whether it committed (then it is applied, else dropped)
        self.pending: dict[str, Any] | None = None
        self.num_dropped_steps = 0
        self.num_read_failures = 0
        self.read_s = 0.0  # time spent copying slots out (benchmarks read it)

    def run(self) -> int:
        """The worker loop; it returns (and the process exits) only once no checkpoint is being written."""
        try:
            code = super().run()
        except BaseException:
            self._wait_for_writer(quiet=True)
            raise
        self._wait_for_writer()
        return code

    # -- registration: the model's step ---------------------------------------------------------
    def _start(self) -> None:
        self.checkpointed_step = self.durable_step = self.backend.load_latest(self.run_dir)
        if self.checkpointed_step:
            log.info("%s: model %s resumes from its checkpoint at step %d", self.name, self.backend.model_id,
                     self.checkpointed_step)

    def _register(self) -> dict[str, Any]:
        backend = self.backend
        while True:
            try:
                reply = self.session.register(contract=backend.contract, model=self._model_fields())
            except ProtocolError as exc:
                if exc.code != ErrorCode.BAD_STATE:
                    raise
                # The model is ahead of the ledger (a commit it applied is not in the journal this
                # dispatcher replayed): go back to the latest checkpoint and register from there.
                ahead = backend.step
                self._reload()
                log.warning("%s: model %s at step %d refused (%s); reloaded its checkpoint at step %d",
                            self.name, backend.model_id, ahead, exc.message, backend.step)
                if backend.step >= ahead:
                    raise RuntimeError(f"model {backend.model_id}: the dispatcher refuses step {ahead} and the "
                                       f"latest checkpoint is at step {backend.step}: {exc.message}") from None
                continue
            self._settle_pending(reply)
            self._check_registered_step(reply)
            return reply

    def _registered(self, registration: dict[str, Any]) -> None:
        # A trainer takes its learning-rate schedule's length from the reply (the jobs of an epoch).
        adopt = getattr(self.backend, "adopt_registration", None)
        if adopt is not None:
            adopt(registration)

    def _settle_pending(self, reply: dict[str, Any]) -> None:
        """Apply the commit the last dispatcher never answered when the ledger holds it, else drop it."""
        if self.pending is None:
            return
        fields, self.pending = self.pending, None
        self.session.held.discard(fields["job_ids"])
        if reply.get("pending_committed"):
            self.backend.apply_step(fields["job_ids"])
            log.info("%s: step %d, sent to the last dispatcher, committed: applied", self.name, fields["step"])
        else:
            self.backend.drop_step()
            self.num_dropped_steps += 1
            log.info("%s: step %d, sent to the last dispatcher, did not commit: dropped", self.name, fields["step"])

    def _check_registered_step(self, reply: dict[str, Any]) -> None:
        ledger_step = reply.get("model_step", self.backend.step)
        if ledger_step != self.backend.step:
            raise RuntimeError(f"the dispatcher holds step {ledger_step} for model {self.backend.model_id}, "
                               f"which registered at step {self.backend.step}: the ledger did not roll back to it")

    def _model_fields(self) -> dict[str, Any]:
        # the checkpoint it holds: one written while no dispatcher listened is known from here on
        pending = {"pending": {k: self.pending[k] for k in ("step", "job_ids")}} if self.pending else {}
        return {"id": self.backend.model_id, "step": self.backend.step,
                "checkpoint": min(self.durable_step, self.backend.step), **pending}

    def _open_transport(self, info: dict[str, Any]) -> DrafterTransport:
        return open_drafter_transport(info, device=self._device(info))

    def _lost(self) -> None:
        if self.commit is not None and not self.window:  # the step's gradients alone: keep them
            self.pending = self.commit[0]
        elif self.window or self.commit is not None:
            self.backend.drop_step()
            self.num_dropped_steps += 1
        self.window, self.commit = [], None
        self.clock.discard_open()

    # -- the loop -----------------------------------------------------------------------------
    def _work(self, registration: dict[str, Any], transport: DrafterTransport) -> None:
        accum_steps = registration["accum_steps"]
        self.window, self.commit = [], None
        self.clock.discard_open()
        reports: list[int] = []
        poll = self._poll("get_hs")
        while True:
            reply = self._await_poll(poll, "get_hs")
            if self.stopping:
                self._stop(reports)
                return
            done, flush, job = reply["done"], reply.get("flush", False), reply["job"]
            if not done:
                poll = self._poll("get_hs")  # prefetch: the next job is asked for before this one computes
            self._report_durable()
            reports = self._collect(reports)
            if job is not None:
                self._train_on(job, transport, reports)
            if self.window and (len(self.window) >= accum_steps or flush or done):
                self._send_commit()
            if self.commit is not None and (job is None or flush or done or self.session.done(self.commit[1])):
                self._settle_commit()  # idle, or answered already: no copy left to overlap it with
            if (flush or done) and not self.window and self.backend.step > self.checkpointed_step:
                self._checkpoint()
            if done:
                self._collect(reports, wait=True)
                log.info("%s: run complete, model %s at step %d (%d steps dropped, %d stale reads)", self.name,
                         self.backend.model_id, self.backend.step, self.num_dropped_steps, self.num_read_failures)
                return

    def _train_on(self, job: dict[str, Any], transport: DrafterTransport, reports: list[int]) -> None:
        batch = self._read(job, transport, reports)
        if batch is None:
            return
        reports.append(self.session.submit("consumed", job_id=job["job_id"]))
        self._settle_commit()  # the previous step's commit was in flight during the copy
        # The compute alone: on a GPU the clock's first event is queued once the copy is waited for,
        # so a stream idle while the host waited for the copy (or the commit) is not counted.
        with self.clock.measure():
            self.backend.micro_batch(job, batch)
        self.window.append(job["job_id"])

    def _read(self, job: dict[str, Any], transport: DrafterTransport, reports: list[int]) -> SlotBatch | None:
        started = time.perf_counter()
        try:
            # On a GPU the copy runs on the transport's copy stream while the micro-batch queued
            # before it computes; the wait is for this copy's event alone, and the slot is
            # released (consumed) as soon as it is complete and its generation still holds.
            copy = transport.start_read(job["slot"], job["generation"], ipc=job.get("ipc"),
                                        owner=job.get("owner") or "")
            return copy.wait()
        except StaleSlotError as exc:
            # The slot was given to another job under us (our lease lapsed): the dispatcher extracts
            # this one again; we carry on with the next.
            self.num_read_failures += 1
            log.warning("%s: job %d: %s; reported, carrying on", self.name, job["job_id"], exc)
            reports.append(self.session.submit("read_failed", job_id=job["job_id"], reason=str(exc)))
            return None
        except PeerMappingError as exc:
            # Every read from that target would fail the same way: give the job back and leave, not
            # to be restarted (the run needs pool.transport=shm, or GPUs with peer access).
            try:
                self.session.call("read_failed", job_id=job["job_id"], reason=str(exc))
            except (ProtocolError, WorkerLost, DispatcherGone):
                pass  # its lease gives it back then
            raise WorkerUnusable(f"{self.name}: {exc}") from None
        finally:
            self.read_s += time.perf_counter() - started

    # -- commit, then apply ---------------------------------------------------------------------
    def _send_commit(self) -> None:
        assert self.commit is None, "one commit in flight at a time"
        self.clock.close_step(self.backend.step + 1)
        busy_s = sum(seconds for _, seconds in self.clock.completed())  # on a GPU: the steps done by now
        fields: dict[str, Any] = {"model": self.backend.model_id, "step": self.backend.step + 1,
                                  "job_ids": list(self.window), "busy_s": busy_s}
        if getattr(self.backend, "verifies_slots", False):
            fields["verified"] = len(self.window)
        metrics = getattr(self.backend, "last_metrics", None)
        if metrics:  # the previous step's figures (this one is applied only once acknowledged)
            fields["metrics"] = {k: v for k, v in metrics.items() if math.isfinite(v)}
        self.commit = (fields, self.session.submit("commit_step", **fields))
        self.window = []
        self.clock.discard_open()

    def _settle_commit(self) -> None:
        """Wait for the commit in flight; apply the step when acknowledged, drop it when refused."""
        if self.commit is None:
            return
        fields, request_id = self.commit
        try:
            self._commit_until_answered(fields, request_id)
        except NoReply:
            raise DispatcherGone(f"commit of step {fields['step']} unanswered for {RECONNECT_S:.0f}s") from None
        except ProtocolError as exc:
            if exc.code != ErrorCode.BAD_STATE:
                raise
            log.warning("%s: step %d refused, dropped: %s", self.name, fields["step"], exc.message)
            self.commit = None
            self.backend.drop_step()
            self.session.held.discard(fields["job_ids"])  # the next heartbeat gives them back
            self.num_dropped_steps += 1
            return
        self.commit = None
        metrics = self.backend.apply_step(fields["job_ids"])
        log.debug("%s: step %d  %d jobs  %.3fs  %s", self.name, self.backend.step, len(fields["job_ids"]),
                  fields["busy_s"], metrics)
        if self.backend.step - self.checkpointed_step >= self.checkpoint_every:
            self._checkpoint()

    def _commit_until_answered(self, fields: dict[str, Any], request_id: int | None = None) -> dict[str, Any]:
        """The reply to the commit of ``fields`` (``request_id``: the one in flight), sent again while
        RECONNECT_S allows: at once when unanswered (a commit is idempotent), a second later when that
        dispatcher could not make it durable (``internal``: its journal failed and it stops; the same
        commit goes to the next one, which answers unknown_worker, and the step is dropped then).

        One classification for a lone drafter and a group's rank 0; what the errors left mean is each
        caller's (NoReply once RECONNECT_S passed, ProtocolError: ``bad_state`` is a refusal, WorkerLost)."""
        step = fields["step"]

        def again(exc: Exception) -> float | None:
            if isinstance(exc, NoReply):
                log.warning("%s: commit of step %d got no reply; sending it again", self.name, step)
                return 0.0
            if isinstance(exc, ProtocolError) and exc.code == ErrorCode.INTERNAL:
                log.warning("%s: commit of step %d failed (%s); sending it again", self.name, step, exc.message)
                return 1.0
            return None
        return resend_until_answered(lambda: self.session.submit("commit_step", **fields),
                                     lambda request_id: self.session.result(request_id, timeout_s=CALL_TIMEOUT_S),
                                     again=again, request_id=request_id)

    def _checkpoint(self, *, best_effort: bool = False) -> None:
        """Start the checkpoint of the applied step: snapshot now, written on the writer's thread.
        The dispatcher hears of it once it is durable (:meth:`_report_durable`)."""
        self._wait_for_writer()  # at most one in flight: the previous one is written first
        self._report_durable(best_effort=best_effort)
        snapshot = getattr(self.backend, "snapshot_checkpoint", None)
        if snapshot is not None:
            self.writer.start(snapshot())
        else:  # a backend that can only write on this thread
            self.backend.save_checkpoint(self.run_dir)
            self._durable(latest_checkpoint(self.run_dir, self.backend.model_id))
        self.checkpointed_step = self.backend.step

    def _wait_for_writer(self, *, quiet: bool = False) -> None:
        """Block until no checkpoint is being written (``quiet``: a failed write is logged, not raised)."""
        try:
            self._durable(self.writer.wait())
        except CheckpointWriteFailed:
            if not quiet:
                raise
            log.exception("%s: the last checkpoint was not written", self.name)

    def _report_durable(self, *, best_effort: bool = False) -> None:
        """Send ``checkpoint {model, step}`` for a checkpoint that became durable (the witness rule:
        never before its files are on disk)."""
        self._durable(self.writer.poll())
        if self.unreported is None:
            return
        step = self.unreported.step
        try:
            if best_effort:
                self.session.call("checkpoint", model=self.backend.model_id, step=step)
            else:
                self.session.call_until_answered("checkpoint", model=self.backend.model_id, step=step)
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

    def _reload(self) -> None:
        """Go back to the latest checkpoint, once the one being written (if any) is published."""
        self._wait_for_writer()
        self.pending = None  # the state it belonged to is gone
        self.checkpointed_step = self.durable_step = self.backend.load_latest(self.run_dir)

    def _stop(self, reports: list[int]) -> None:
        """A clean stop: settle the commit in flight, drop the partial step, save what was applied."""
        try:
            self._settle_commit()
            self._collect(reports, wait=True)
        except (WorkerLost, DispatcherGone) as exc:
            log.warning("%s: stopping without the last answers: %s", self.name, exc)
            self._lost()
        if self.window:
            self.backend.drop_step()
            self.session.held.discard(self.window)
            self.window = []
        self.clock.discard_open()
        self._finish_checkpoints()

    def _finish_checkpoints(self) -> None:
        """On a stop: checkpoint what was applied, wait for it to be written, tell the dispatcher if it listens."""
        if self.backend.step > self.checkpointed_step:
            self._checkpoint(best_effort=True)
        self._wait_for_writer()
        self._report_durable(best_effort=True)
