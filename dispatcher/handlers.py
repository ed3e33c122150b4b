"""The dispatcher's handlers: each decoded request type mapped to the core call it stands for.

:class:`ControlHandlers` holds the table (request type -> handler) of the control socket; a handler
turns the typed request into one :class:`DispatcherCore` call and its result into the reply struct,
and the core's refusals into typed errors: nothing a peer sends escapes as an exception but a
storage failure, which stops the dispatcher. A reply that acknowledges a journal line goes
through the durable-reply gate (``when_durable``) instead of straight back. :class:`StatsView`
answers the read-only stats socket. No socket is touched here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import faults
from common.run.config import DispatcherSection, DrafterSection, RunSection, ScheduleSection
from common.run.durable import StorageFailed
from common.wire import messages
from common.wire.messages import ErrorCode, ProtocolError
from common.wire.stats_snapshot import CoreSnapshot, Snapshot, serving_snapshot
from dispatcher.auth import CurveAuth
from dispatcher.core import DispatcherCore
from dispatcher.core_types import Incompatible, Unauthorized, UnknownWorker
from dispatcher.groups import GroupChanged
from dispatcher.ledger import LedgerError
from dispatcher.liveness import ProcessWatch
from dispatcher.long_polls import LongPolls, counted_error, model_step
from dispatcher.loop_cpu import LoopCpu
from dispatcher.nodes import node_summary
from dispatcher.snapshot import snapshot_steps
from dispatcher.transport_setup import DataPlane

log = logging.getLogger("hsd.dispatcher")

Reply = messages.Reply
Handler = Callable[[Any, bytes, float], "Reply | None"]  # (the typed request, its sender, now)
WhenDurable = Callable[..., "Reply | None"]  # (identity, reply, *, exit_once_durable=False): the reply now, or None


@dataclass(frozen=True)
class RegisterTerms:
    """What a register reply tells every worker of the run, besides its own session."""

    run_id: str
    heartbeat_s: float
    worker_timeout_s: float
    accum_steps: int
    buckets: tuple[int, ...]
    epochs: int

    @classmethod
    def of(cls, run_id: str, *, dispatcher: DispatcherSection, drafter: DrafterSection, schedule: ScheduleSection,
           run: RunSection) -> "RegisterTerms":
        return cls(run_id=run_id, heartbeat_s=dispatcher.heartbeat_s, worker_timeout_s=dispatcher.worker_timeout_s,
                   accum_steps=drafter.accum_steps, buckets=tuple(schedule.buckets), epochs=run.epochs)


class ControlHandlers:
    def __init__(self, core: DispatcherCore, *, data_plane: DataPlane, polls: LongPolls, liveness: ProcessWatch,
                 terms: RegisterTerms, when_durable: WhenDurable, run_dir: Path):
        self.core = core
        self.data_plane = data_plane
        self.polls = polls
        self.liveness = liveness
        self.terms = terms
        self.when_durable = when_durable
        self.run_dir = run_dir
        self.table = self._op_handlers()
        self.state_changed = False  # set before each handler; lowered when nothing changed a parked poll waits on

    def handle(self, request: messages.Request, identity: bytes, now: float) -> tuple[Reply | None, bool]:
        """The reply to a decoded control request (None: it waits, parked or held), and whether the
        core's state changed."""
        request_id = None
        try:
            request_id, op = request.id, messages.op_of(request)
            self.core.counters.requests[op] += 1
            handler = self.table.get(type(request))
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_OP, f"{op} is served on the stats socket")
            if isinstance(request, messages.WorkerRequest):
                if not request.worker_id:
                    raise ProtocolError(ErrorCode.MALFORMED, f"{op}: missing field worker_id")
                self.core.authenticate(request.worker_id, request.token, now)
            self.state_changed = True
            return handler(request, identity, now), self.state_changed
        except ProtocolError as exc:
            return self.error(exc.request_id if exc.request_id is not None else request_id, exc.code, exc.message), False
        except UnknownWorker as exc:
            return self.error(request_id, ErrorCode.UNKNOWN_WORKER, f"worker {exc.args[0]} is not registered"), False
        except Unauthorized as exc:
            return self.error(request_id, ErrorCode.UNAUTHORIZED, str(exc)), False
        except Incompatible as exc:
            return self.error(request_id, ErrorCode.INCOMPATIBLE, str(exc)), False
        except GroupChanged as exc:
            return self.error(request_id, ErrorCode.GROUP_CHANGED, str(exc)), False
        except StorageFailed:
            raise  # fail closed: the loop stops the dispatcher
        except LedgerError as exc:
            return self.error(request_id, ErrorCode.BAD_STATE, str(exc)), False
        except Exception as exc:  # a bug must not take the run down with it
            log.exception("internal error")
            return self.error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False

    def error(self, request_id: int | None, code: str, message: str) -> messages.ErrorReply:
        return counted_error(self.core, request_id, code, message)

    def sweep(self, now: float) -> list[str]:
        """The core's sweep, a same-host worker whose process ended counted dead (dispatcher.liveness)."""
        self.liveness.collect()
        dead = self.core.sweep(now, self.liveness.is_alive)
        self.liveness.forget_except(self.core.workers)
        return dead

    # -- the ops: one handler per request type --------------------------------------------------
    def _op_handlers(self) -> dict[type, Handler]:
        m = messages
        return {m.Register: self._on_register, m.Heartbeat: self._on_heartbeat, m.GetJob: self._on_poll,
                m.GetHS: self._on_poll, m.JoinGroup: self._on_poll, m.JobReady: self._on_job_ready,
                m.RegisterSlots: self._on_register_slots, m.JobFailed: self._on_job_failed,
                m.Consumed: self._on_consumed, m.ReadFailed: self._on_read_failed,
                m.CommitStep: self._on_commit_step, m.StepOutcome: self._on_step_outcome,
                m.Checkpoint: self._on_checkpoint, m.Deregister: self._on_deregister}

    def _on_register(self, request: messages.Register, identity: bytes, now: float) -> messages.RegisterReply:
        role, model, core = request.role, request.model, self.core
        self.data_plane.check_worker(request)
        worker = core.register(role=role, name=request.name, pid=request.pid, host=request.host, gpu=request.gpu,
                               contract=request.contract, model=model, node=request.node, now=now,
                               tp_ranks=[(r.rank, r.pid, r.gpu) for r in request.tp_ranks or []])
        log.info("%s %s registered (%s pid %d on %s%s)", role, worker.id, worker.name, worker.pid, worker.host,
                 f", model {worker.model} at step {model.step}" if model is not None else "")
        terms = self.terms
        return messages.RegisterReply(
            id=request.id, worker_id=worker.id, token=worker.token, contract=core.contract, run_id=terms.run_id,
            transport=self.data_plane.info(role, worker.node), heartbeat_s=terms.heartbeat_s,
            worker_timeout_s=terms.worker_timeout_s, accum_steps=terms.accum_steps,
            buckets=list(terms.buckets), epochs=terms.epochs,
            model_step=core.ledger.model_step.get(worker.model, 0) if worker.model else None,
            pending_committed=worker.pending_committed,
            jobs_per_epoch=core.store.jobs_per_epoch if role == "drafter" else None)

    def _on_heartbeat(self, request: messages.Heartbeat, identity: bytes, now: float) -> messages.Done:
        given_back = self.core.counters.given_back["not_held"]
        worker = self.core.heartbeat(request.worker_id, now, request.holding, request.seen_grant, gpu=request.gpu,
                                     copies=request.copies)
        self.state_changed = self.core.counters.given_back["not_held"] != given_back
        return messages.Done(id=request.id, done=self.core.done,
                             membership=worker.group.version if worker.group is not None else 0)

    def _on_poll(self, request: messages.GetJob | messages.GetHS | messages.JoinGroup, identity: bytes,
                 now: float) -> Reply | None:
        self.core.worker(request.worker_id, now)
        joining = isinstance(request, messages.JoinGroup)
        if joining and request.failed:  # a peer's collective failed: a dead rank must not be in the next version
            self.sweep(now)
        reply, served = self.polls.poll(identity, request, now)
        self.state_changed = served or (reply is None and joining)  # a parked join may open a version
        return reply

    def _on_job_ready(self, request: messages.JobReady, identity: bytes, now: float) -> messages.Ack:
        self.core.job_ready(request.worker_id, request.job_id, request.generation, request.busy_s, now)
        return messages.Ack(id=request.id)

    def _on_register_slots(self, request: messages.RegisterSlots, identity: bytes, now: float) -> messages.Ack:
        if self.data_plane.kind not in ("cuda_ipc", "nixl"):
            raise ProtocolError(ErrorCode.INCOMPATIBLE, f"this run uses the {self.data_plane.kind} transport")
        self.core.register_slots(request.worker_id, request.ipc_block, request.num_slots, now)
        return messages.Ack(id=request.id)

    def _on_job_failed(self, request: messages.JobFailed, identity: bytes, now: float) -> messages.Ack:
        self.core.job_failed(request.worker_id, request.job_id, request.reason, now)
        return messages.Ack(id=request.id)

    def _on_consumed(self, request: messages.Consumed, identity: bytes, now: float) -> messages.Ack:
        self.core.consumed(request.worker_id, request.job_id, now)
        return messages.Ack(id=request.id)

    def _on_read_failed(self, request: messages.ReadFailed, identity: bytes, now: float) -> messages.Ack:
        self.core.read_failed(request.worker_id, request.job_id, request.reason, now)
        return messages.Ack(id=request.id)

    def _on_commit_step(self, request: messages.CommitStep, identity: bytes, now: float) -> Reply | None:
        core, worker_id = self.core, request.worker_id
        step = core.commit_step(worker_id, request.job_ids, request.busy_s, now, model=request.model,
                                step=request.step, verified=request.verified, metrics=request.metrics,
                                sync_wait_s=request.sync_wait_s, step_s=request.step_s,
                                membership=request.membership, rank_jobs=request.rank_jobs,
                                rank_busy_s=request.rank_busy_s, cost_jobs=request.cost_jobs)
        group = core.groups.group_of_rank(worker_id)
        reply = messages.CommitReply(id=request.id, step=step, done=core.done,
                                     membership=group.version if group is not None else None)
        return self.when_durable(identity, reply, exit_once_durable=faults.exit_before_commit_reply(self.run_dir, step))

    def _on_step_outcome(self, request: messages.StepOutcome, identity: bytes, now: float) -> Reply | None:
        committed = self.core.step_outcome(request.worker_id, now, model=request.model, step=request.step,
                                           job_ids=request.job_ids, membership=request.membership)
        return self.when_durable(identity, messages.OutcomeReply(
            id=request.id, committed=committed, model_step=model_step(self.core, request.worker_id)))

    def _on_checkpoint(self, request: messages.Checkpoint, identity: bytes, now: float) -> Reply | None:
        self.core.checkpoint(request.worker_id, request.step, now, model=request.model, metrics=request.metrics)
        return self.when_durable(identity, messages.Done(id=request.id, done=self.core.done))

    def _on_deregister(self, request: messages.Deregister, identity: bytes, now: float) -> messages.Ack:
        self.polls.drop(request.worker_id)
        self.core.deregister(request.worker_id, now)
        return messages.Ack(id=request.id)


@dataclass(frozen=True)
class StatsView:
    """The stats socket's one op, and the snapshot it and the metrics endpoint send, built in steps."""

    core: DispatcherCore
    data_plane: DataPlane
    polls: LongPolls
    auth: CurveAuth
    secret: bool  # whether requests carry dispatcher.secret
    run_dir: Path
    run_id: str
    loop_cpu: LoopCpu

    @staticmethod
    def check(request: messages.Request) -> None:
        """Raise READ_ONLY for anything but ``stats`` (the loop builds its snapshot in steps)."""
        if not isinstance(request, messages.Stats):
            raise ProtocolError(ErrorCode.READ_ONLY,
                                f"the stats socket serves only 'stats', not {messages.op_of(request)!r}")

    def snapshot_steps(self, *, workers_a_step: int) -> Generator[None, None, Snapshot]:
        """The snapshot in steps (:func:`dispatcher.snapshot.snapshot_steps`), the loop serving
        requests between them: it yields after each ``workers_a_step`` workers and before the parts
        that walk every worker or slot again."""
        core_snapshot = yield from snapshot_steps(self.core, workers_a_step=workers_a_step)
        yield
        return self._serving(core_snapshot)

    def _serving(self, core_snapshot: CoreSnapshot) -> Snapshot:
        core = self.core
        return serving_snapshot(
            core_snapshot, run_dir=str(self.run_dir), run_id=self.run_id,
            pid=os.getpid(), transport=self.data_plane.view(), waiters=len(self.polls),
            auth=self.auth.stats(secret=self.secret), loop_cpu_s=self.loop_cpu.seconds(),
            loop_wakeups=self.loop_cpu.wakeups,
            nodes=node_summary(core.pool, core.registry.on_node, core.counters.reads, home=self.data_plane.node))
