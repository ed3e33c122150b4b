"""A drafter worker: accumulate a step of micro-batches, commit it, apply it once it is durable.

One loop for a lone drafter and for a rank of a data-parallel group: a lone drafter is a group of
one. The group-specific parts (membership versions, rendezvous, the job exchange, the gradient sum,
the outcome's broadcast, state transfer) are its *step group* (:mod:`drafter_worker.step_group`:
:class:`~drafter_worker.step_group.LoneGroup`, which opens nothing, and
:class:`~drafter_worker.elastic_group.ElasticGroup`); the commit and its outcome are one object
(:class:`drafter_worker.commit.StepCommits`), checkpoints another
(:class:`drafter_worker.checkpointing.Checkpoints`). The loop builds them, each given what it uses
(the session, the backend, the drafter section, the :class:`~drafter_worker.step_group.DrafterState`
they share), and none sees the loop.

The handshake with the dispatcher (protocol v3), in the order the loop keeps:

- start: load the model's latest checkpoint and register with its ``model`` claim (id, step); the ledger
  rolls the model back to exactly that step. A model ahead of the ledger reloads its checkpoint and
  registers again. A rank then joins its group's version (:mod:`drafter_worker.elastic_group`).
- a step: ``get_hs``, copy the slot out, ``consumed``, the backend's ``micro_batch``. The next
  ``get_hs`` is in flight while the slot is copied, and ``consumed`` follows on its own; a lone
  drafter whose micro-batches take longer than a round trip (any on a GPU, where the next slot's
  copy overlaps the compute) instead sends its next ``get_hs`` once the slot is copied out,
  carrying that ``consumed``: a slot then costs the dispatcher one message, not two, and the grant
  arrives while the micro-batch computes. A rank reports ``consumed`` on its own, answered before
  its rank 0 commits. On a GPU the copy of slot N+1 runs on the transport's copy stream while
  micro-batch N computes (:meth:`common.dataplane.transport.DrafterTransport.start_read`): the slot is
  released once the copy's event completes, and the compute stream waits on that event, not the
  host on the compute stream. After its share of the step (``accum_steps`` micro-batches alone;
  fewer when the dispatcher says ``flush``), the **round**: the ranks exchange their job ids and
  flags, sum their gradients (nothing to do alone), rank 0 sends ``commit_step {model, step:
  current + 1, job_ids}``, and once it is answered every rank applies the step (weights, witness)
  when acknowledged, or drops it when refused (its jobs leave the held set, so the dispatcher gives
  them back). No answer → the same commit again (it is idempotent).
- what differs between a lone drafter and a rank is explicit and small, and comes from one fact: a
  rank's peers wait for it, a lone drafter's do not. The step group says each (the loop asks it,
  never which one it is). So a lone drafter sends its commit and copies
  its next slot while it is in flight (it settles it before the next micro-batch); it leaves its
  commit pending when the dispatcher restarts, and settles it when it registers again
  (:mod:`drafter_worker.commit`); asked to stop it drops its partial step and stops, where a rank
  brings its partial step to a last round; it sends its commit on the channel its ``consumed``
  reports went ahead on, where rank 0 commits only once every rank's reports are answered.
- checkpoints: every ``drafter.checkpoint_every`` steps, and when the dispatcher says nothing more
  is coming (``flush`` with an empty window, or ``done``) while steps are not yet checkpointed
  (:mod:`drafter_worker.checkpointing`). The dispatcher says ``done`` only once every model's last
  commit is checkpointed; the process exits only once its last write is on disk.
- a slot rewritten before or under the copy (StaleSlotError, also when found once the copy's event
  completed): ``read_failed``, and on to the next job.
- the dispatcher restarted (unknown worker): the pending step is dropped (its jobs were given back)
  and the drafter registers again with the step it has applied.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from common import faults
from common.run.checkpoint_writer import CheckpointWriter
from common.run.config import Config, DispatcherSection, DrafterSection
from common.run.descriptors import TransportInfo
from common.dataplane.cuda_ipc import PeerMappingError
from common.wire import messages
from common.wire.messages import ErrorCode, ProtocolError
from common.dataplane.slots import SlotBatch, StaleSlotError
from common.dataplane.transport import DrafterTransport, open_drafter_transport
from common.worker.backends import DrafterBackend
from common.worker.loop import WorkerLoop
from common.worker.runtime import DispatcherAddress, DispatcherGone, WorkerLost, WorkerUnusable
from drafter_worker.busy_clock import BusyClock
from drafter_worker.checkpointing import Checkpoints
from drafter_worker.commit import StepCommits
from drafter_worker.step_group import (GROUP_NEVER_FORMED_EXIT, LEAVE, NEXT_VERSION, RUN_DONE, DrafterState,
                                       GroupNeverFormed, LoneGroup, RankRound, RoundEnd)

if TYPE_CHECKING:
    from drafter_worker.elastic_group import ElasticGroup

log = logging.getLogger("hsd.drafter")


class DrafterLoop(WorkerLoop):
    role = "drafter"

    def __init__(self, address: DispatcherAddress, name: str, backend: DrafterBackend, *, drafter: DrafterSection,
                 dispatcher: DispatcherSection, run_dir: str | os.PathLike, grouped: bool = False,
                 rendezvous: str = "file", **kwargs: Any):
        """``drafter``, ``dispatcher``: the run's sections; ``grouped``: a rank of a data-parallel group
        (drafter.data_parallel, several ranks), else a lone drafter; ``rendezvous``: a group's, file
        or tcp (:attr:`common.run.config.Config.group_rendezvous`)."""
        super().__init__(address, name, backend, **kwargs)
        self.run_dir = run_dir
        self.checkpoint_every = drafter.checkpoint_every
        self.state = DrafterState(accum=drafter.accum_steps)
        self.writer = CheckpointWriter(run_dir, name=name)
        self.checkpoints = Checkpoints(name=name, run_dir=run_dir, backend=backend, session=self.session,
                                       writer=self.writer, state=self.state, dispatcher=dispatcher)
        self.window: list[int] = []  # job ids of the step being accumulated
        self.clock = BusyClock(backend.device or "cpu")  # the micro-batches' compute time
        # the consumed reports the poll in flight carries (a lone drafter's): asked again, it carries them again
        self.poll_consumed: list[int] = []
        self.read_s = 0.0  # time spent copying slots out (benchmarks read it)
        self._kill_at = faults.kills_armed()  # test-only (common.faults): kill_at points of a rank with peers
        parts = dict(name=name, session=self.session, backend=backend, state=self.state, clock=self.clock)
        self.group: LoneGroup | ElasticGroup
        if grouped:
            from drafter_worker.elastic_group import ElasticGroup  # torch.distributed: only a rank loads it
            self.group = ElasticGroup(drafter, checkpoints=self.checkpoints, stopping=lambda: self.stopping,
                                      rendezvous=rendezvous, control_endpoint=address.endpoint, **parts)
        else:
            self.group = LoneGroup(**parts)
        self.commits = StepCommits(name=name, session=self.session, backend=backend, group=self.group,
                                   state=self.state, checkpoints=self.checkpoints, stopping=lambda: self.stopping,
                                   fault=self._test_fault)

    @classmethod
    def from_config(cls, config: Config, name: str, backend: DrafterBackend, **kwargs: Any) -> DrafterLoop:
        return cls(DispatcherAddress.from_config(config), name, backend, drafter=config.drafter,
                   dispatcher=config.dispatcher, run_dir=config.run_dir, rendezvous=config.group_rendezvous,
                   **kwargs)

    def run(self) -> int:
        """The worker loop; it returns (and the process exits) only once no checkpoint is being written.
        No version to train in is an error exit (the session has left by then)."""
        try:
            try:
                code = super().run()
            except BaseException:
                self.checkpoints.wait_for_writer(quiet=True)
                raise
            self.checkpoints.wait_for_writer()
            return code
        except GroupNeverFormed as exc:
            log.error("%s: %s", self.name, exc)
            return GROUP_NEVER_FORMED_EXIT

    # -- registration: the model's step ---------------------------------------------------------
    def _start(self) -> None:
        self.checkpoints.load_latest()
        if self.state.checkpointed_step:
            log.info("%s: model %s resumes from its checkpoint at step %d", self.name, self.backend.model_id,
                     self.state.checkpointed_step)

    def _register(self) -> messages.RegisterReply:
        backend = self.backend
        while True:
            try:
                reply = self.session.register(contract=backend.contract, model=self._model_claim())
            except ProtocolError as exc:
                if exc.code != ErrorCode.BAD_STATE:
                    raise
                # The model is ahead of the ledger (a commit it applied is not in the journal this
                # dispatcher replayed): go back to the latest checkpoint and register from there.
                ahead = backend.step
                self.checkpoints.reload()
                log.warning("%s: model %s at step %d refused (%s); reloaded its checkpoint at step %d",
                            self.name, backend.model_id, ahead, exc.message, backend.step)
                if backend.step >= ahead:
                    raise RuntimeError(f"model {backend.model_id}: the dispatcher refuses step {ahead} and the "
                                       f"latest checkpoint is at step {backend.step}: {exc.message}") from None
                continue
            self.commits.settle_pending(reply)
            self.group.registered(reply)
            return reply

    def _registered(self, registration: messages.RegisterReply) -> None:
        # A trainer takes its learning-rate schedule's length from the reply (the jobs of an epoch).
        self.backend.adopt_registration(registration)

    def _model_claim(self) -> messages.ModelClaim:
        # the checkpoint it holds: one written while no dispatcher listened is known from here on
        return messages.ModelClaim(id=self.backend.model_id, step=self.backend.step,
                                   checkpoint=min(self.checkpoints.durable_step, self.backend.step),
                                   pending=self.state.pending, group=self.group.group_claim())

    def _open_transport(self, info: TransportInfo) -> DrafterTransport:
        return open_drafter_transport(info, device=self._device(info))

    def _lost(self) -> None:
        self.group.close()
        self.commits.lost(partial=bool(self.window))
        self.window, self.poll_consumed = [], []
        self.clock.discard_open()

    def _poll_request(self) -> messages.GetHS:
        return messages.GetHS(wait_ms=self.poll_ms, membership=self.group.poll_membership(),
                              consumed=self.poll_consumed)  # replaced, never changed in place

    # -- the loop -----------------------------------------------------------------------------
    def _work(self, registration: messages.RegisterReply, transport: DrafterTransport) -> None:
        self.group.start(registration)
        while True:
            ended = self.group.run_version(lambda: self._train(transport))
            if self.window:
                self.backend.drop_step()
                self.state.num_dropped_steps += 1
                self.window = []
                self.clock.discard_open()
            if ended in (RUN_DONE, LEAVE):
                return

    def _train(self, transport: DrafterTransport) -> str:
        """Train until this version ends (a lone drafter's: the run is done, or it stops); how it ended."""
        self.window, self.commits.in_flight = [], None
        reports: list[int] = []
        poll: int | None = self._poll()
        while True:
            reply = self._await_poll(poll)
            poll, self.poll_consumed = None, []
            leaving = self.stopping
            done, flush, job = reply.done, reply.flush, reply.job
            # step_balance=cost: the dispatcher says when this rank holds its share of the step (a
            # reply about a step that has committed since is stale)
            full = reply.step_full == self.backend.step + 1
            if leaving:
                self.group.leave(lambda: self._drop_partial_step(reports))
            else:
                # A lone drafter whose compute hides a round trip asks for its next job once this
                # one is copied out, the poll carrying its consumed report: one message a slot. A
                # rank's consumed goes on its own, acknowledged before its rank 0 commits.
                carry = self.group.carries_consumed(job, done)
                if not done and not carry:  # told step_full too: the dispatcher holds this poll until the step commits
                    poll = self._poll()  # prefetch: the next job is asked for before this one computes
                self.checkpoints.report_durable()  # rank 0's checkpoint, once its writer has it on disk
                reports = self._collect(reports)
                if job is not None:
                    sent = self._train_on(job, transport, reports, carry=carry)
                    if sent is not None:
                        poll = sent
            if leaving or full or len(self.window) >= self.state.accum or flush or done:
                reports = self.group.reports_before_round(reports, self._collect)
                ended = self._round(done=done and not leaving, flush=flush, leaving=leaving, no_job=job is None)
                if ended is not None:
                    if ended == RUN_DONE:
                        self._collect(reports, wait=True)
                        self.group.run_complete()
                    return ended
            elif self.commits.in_flight is not None and (job is None or self.commits.answered()):
                self._settle_commit()  # idle, or answered already: no copy left to overlap it with
            if poll is None:
                poll = self._poll()

    def _train_on(self, job: messages.Job, transport: DrafterTransport, reports: list[int], *,
                  carry: bool) -> int | None:
        """One micro-batch on ``job``; the poll it sent (``carry``: the next poll carries its consumed report)."""
        if len(self.window) == 1:
            self._test_fault("micro_batch")
            if self._kill_at:  # inside autograd's backward of this micro-batch, whatever the backend
                def unpacked(tensor: torch.Tensor) -> torch.Tensor:  # autograd unpacks saved tensors in backward
                    self._test_fault("backward")
                    return tensor

                with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpacked):
                    return self._micro_batch(job, transport, reports, carry=carry)
        return self._micro_batch(job, transport, reports, carry=carry)

    def _micro_batch(self, job: messages.Job, transport: DrafterTransport, reports: list[int], *,
                     carry: bool) -> int | None:
        batch = self._read(job, transport, reports)
        if batch is None:
            return None
        poll = None
        if carry:
            self.poll_consumed = [job.job_id]
            poll = self._poll()
        else:
            reports.append(self.session.submit(messages.Consumed(job_id=job.job_id)))
        self._settle_commit()  # a lone drafter's previous commit was in flight during the copy
        # The compute alone: on a GPU the clock's first event is queued once the copy is waited for,
        # so a stream idle while the host waited for the copy (or the commit) is not counted.
        with self.clock.measure():
            self.backend.micro_batch(job, batch)
        self.window.append(job.job_id)
        return poll

    def _read(self, job: messages.Job, transport: DrafterTransport, reports: list[int]) -> SlotBatch | None:
        started = time.perf_counter()
        try:
            # On a GPU the copy runs on the transport's copy stream while the micro-batch queued
            # before it computes; the wait is for this copy's event alone, and the slot is
            # released (consumed) as soon as it is complete and its generation still holds.
            copy = transport.start_read(job.slot, job.generation, ipc=job.ipc, owner=job.owner or "")
            return copy.wait()
        except StaleSlotError as exc:
            # The slot was given to another job under us (our lease lapsed): the dispatcher extracts
            # this one again; we carry on with the next.
            self.state.num_read_failures += 1
            log.warning("%s: job %d: %s; reported, carrying on", self.name, job.job_id, exc)
            reports.append(self.session.submit(messages.ReadFailed(job_id=job.job_id, reason=str(exc))))
            return None
        except PeerMappingError as exc:
            # Every read from that target would fail the same way: give the job back and leave, not
            # to be restarted (the run needs pool.transport=shm, or GPUs with peer access).
            try:
                self.session.call(messages.ReadFailed(job_id=job.job_id, reason=str(exc)))
            except (ProtocolError, WorkerLost, DispatcherGone):
                pass  # its lease gives it back then
            raise WorkerUnusable(f"{self.name}: {exc}") from None
        finally:
            self.read_s += time.perf_counter() - started
            self.copy_times.add(time.perf_counter() - started)

    # -- the round ------------------------------------------------------------------------------
    def _round(self, *, done: bool, flush: bool, leaving: bool, no_job: bool) -> str | None:
        """One step boundary of the group (a lone drafter: alone): every rank's jobs, the summed
        gradients, rank 0's commit and its outcome; how the version ends, if it does. ``no_job``: none
        came with this poll (a lone drafter has no copy to overlap its commit with)."""
        self._settle_commit()  # a lone drafter's commit still in flight: its outcome comes first
        group = self.group
        group.await_local_compute()  # the wait timed below is for the others, not this rank's own queue
        ready_at = time.perf_counter()
        busy_step, busy_s = group.measure_round(self.backend.step + 1, self.window)
        rounds = group.exchange(RankRound(group.rank, list(self.window), done, flush, busy_us=int(busy_s * 1e6),
                                          leaving=leaving, busy_step=busy_step))
        job_ids = [job_id for r in rounds for job_id in r.job_ids]
        if not job_ids:
            return self._round_end(RoundEnd(rounds, stepped=False, after=group.version))
        group.sync_gradients(self._all_reduce)
        if group.rank == 0:
            self._test_fault("commit")  # its peers wait for the outcome
        self.commits.send(job_ids, self.window, rounds, busy_s=busy_s, wait_s=time.perf_counter() - ready_at)
        self.window = []
        if not group.settles_now(no_job=no_job, flush=flush, done=done, answered=self.commits.answered):
            return None  # settled before the next micro-batch: the next slot is copied while it is in flight
        return self._settle_commit()

    def _settle_commit(self) -> str | None:
        """The outcome of the step in flight, applied or dropped on every rank; how the version ends after it."""
        ended = self.commits.settle()
        return None if ended is None else self._round_end(ended)

    def _round_end(self, ended: RoundEnd) -> str | None:
        """After a round (``stepped``: it applied a step; ``after``: the group's version then): the
        checkpoints it calls for, and how the version ends. Every rank leaving saves what was applied;
        nothing more coming does too, in a round that holds no jobs — the one after a group's last
        step; a lone drafter has no other rank to hold that round with, so it needs no such round
        (:meth:`~drafter_worker.step_group.LoneGroup.idle_round`)."""
        rounds, stepped, group = ended.rounds, ended.stepped, self.group
        mine = rounds[group.rank]
        idle = group.idle_round(stepped)
        checkpointed_step = self.state.checkpointed_step
        if all(r.leaving for r in rounds):
            self.checkpoints.save_applied(group.rank, all_leave=True)
        elif idle and all(r.flush or r.done or r.leaving for r in rounds) and self.backend.step > checkpointed_step:
            self.checkpoints.save_applied(group.rank)
        if idle and any(r.done for r in rounds):
            return RUN_DONE
        if any(r.leaving for r in rounds):
            return LEAVE if mine.leaving else NEXT_VERSION
        if stepped and ended.after != group.version:
            return NEXT_VERSION  # ranks wait to join at this step boundary
        if stepped and self.backend.step - self.state.checkpointed_step >= self.checkpoint_every:
            self.checkpoints.save_applied(group.rank)
        return None

    def _drop_partial_step(self, reports: list[int]) -> None:
        """A lone drafter asked to stop: its commit in flight settled, its partial step dropped (its
        jobs go back); its last round then saves what was applied."""
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

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._test_fault("allreduce")  # the peers are in the all-reduce, waiting for this rank
        self.group.all_reduce(tensor)

    def _test_fault(self, point: str) -> None:
        """``kill_at``, ``stop_at``: only in a step this rank trains with peers."""
        if self._kill_at and self.group.world_size > 1:
            faults.kill_at(self.name, point, step=self.backend.step + 1, run_dir=self.run_dir)
