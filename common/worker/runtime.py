"""A worker's session with the dispatcher: registration, the session token, held jobs, heartbeats.

Every request after ``register`` carries the worker id and the token registration returned. The
session keeps the set of jobs the worker holds (:class:`HeldJobs`) and lists it in every heartbeat,
which the control channel's I/O thread sends on the same socket as the worker's requests (when the
worker sent none within the interval: :mod:`common.wire.heartbeats`). When the
dispatcher restarts it no longer knows the worker: calls then raise :class:`WorkerLost`, and the
worker registers again (:mod:`common.worker.loop`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgspec

from common.wire import messages
from common.wire.client import RECONNECT_S, DispatcherUnavailable
from common.run.capture_contract import CaptureContract
from common.run.config import Config, CurveSection
from common.wire.control_channel import ControlChannel
from common.wire.curve import client_from_config
from common.worker.held_jobs import HeldJobs
from common.wire.messages import ErrorCode, ProtocolError

log = logging.getLogger("hsd.worker")

CALL_TIMEOUT_S = 10.0
# A wait for a reply that overruns its bound by more than this was not spent waiting: the process was
# paused (SIGSTOP, a suspended laptop or VM). Scheduling on a loaded host overruns by far less.
PAUSE_SLACK_S = 5.0
# Requests whose reply (any reply) settles a held job: a target's report, a drafter's read failure.
_RELEASES = (messages.JobReady, messages.JobFailed, messages.ReadFailed)


class WorkerLost(Exception):
    """The dispatcher no longer knows this worker (it restarted, or declared the worker dead)."""

    what = "the dispatcher lost track of us"  # how the worker's log line tells why it registers again


class NoReply(WorkerLost):
    """A request got no reply: the dispatcher is down, restarting, or the reply was lost. A caller that
    can repeat its request (an idempotent commit, a poll) does; any other starts over, as if lost."""


class DispatcherGone(Exception):
    """The dispatcher stayed unreachable for ``dispatcher.reconnect_s`` (RECONNECT_S by default)."""


# sysexits' EX_CONFIG: the exit code of a worker that cannot work in this run as it is configured.
EXIT_UNUSABLE = 78


class WorkerUnusable(RuntimeError):
    """This worker cannot work in this run as configured (e.g. its GPU cannot map the targets' cuda_ipc
    slots): it exits with :data:`EXIT_UNUSABLE`, which ``hsd launch`` does not restart."""


T = TypeVar("T")


def resend_until_answered(send: Callable[[], int], wait: Callable[[int], T], *,
                          again: Callable[[Exception], float | None], request_id: int | None = None,
                          deadline_s: float = RECONNECT_S, wait_s: float = CALL_TIMEOUT_S) -> T:
    """The reply to a request the dispatcher may never answer (it is down, restarting, or lost it):
    ``wait(request_id)`` for the one in flight (``send()`` first when there is none), and while that
    fails, ``send()`` it again, until ``deadline_s`` of this process's waking time has passed.

    ``again(error)`` classifies each error before it is sent again: the seconds to pause first (0: at
    once; it logs why, as each caller words it), or None when the error is final. A final error, and
    any error once the deadline has passed, is raised: the caller says what it means.

    The deadline counts only time the process was running. A wait that lasted far longer than its
    bound (``wait_s``) was not a wait on the dispatcher: the process was stopped (SIGSTOP) or its
    host slept or migrated, and the monotonic clock ran on meanwhile. Such a try proves nothing —
    the reply may have come and been dropped, the dispatcher may have declared this worker dead —
    so its time does not count, and the request is sent again before the dispatcher can be called
    gone.
    """
    deadline = time.monotonic() + deadline_s
    if request_id is None:
        request_id = send()
    while True:
        started = time.monotonic()
        try:
            return wait(request_id)
        except Exception as exc:
            now = time.monotonic()
            if now - started > wait_s + PAUSE_SLACK_S:
                log.warning("a wait for the dispatcher's reply lasted %.0fs, its bound %.0fs: this process was "
                            "paused (stopped, or its host asleep); asking again", now - started, wait_s)
                deadline += now - started
            if now > deadline:
                raise
            pause_s = again(exc)
            if pause_s is None:
                raise
        if pause_s:
            time.sleep(pause_s)
        request_id = send()


def on_no_reply(logger: logging.Logger, message: str, *args: Any,
                unless: Callable[[], bool] = lambda: False) -> Callable[[Exception], float | None]:
    """The ``again`` of :func:`resend_until_answered` for a request lost only when unanswered: NoReply
    is sent again at once once ``message`` is logged, unless ``unless()``; any other error is final."""
    def again(exc: Exception) -> float | None:
        if not isinstance(exc, NoReply) or unless():
            return None
        logger.warning(message, *args)
        return 0.0
    return again


@dataclass(frozen=True)
class DispatcherAddress:
    """What a worker's session needs to reach its dispatcher: the control endpoint, the shared
    secret, the connecting side's CURVE keys (the ``curve`` section), the node it names when it
    registers and how long it keeps asking one that does not answer (:meth:`from_config`: a run
    config's)."""

    endpoint: str
    secret: str = ""
    curve: CurveSection = field(default_factory=CurveSection)
    node: str = ""  # empty = this host's name
    reconnect_s: float = RECONNECT_S  # dispatcher.reconnect_s

    @classmethod
    def from_config(cls, config: Config) -> DispatcherAddress:
        return cls(endpoint=config.control_endpoint, secret=config.dispatcher.secret, curve=config.curve,
                   node=config.nodes.name, reconnect_s=config.dispatcher.reconnect_s)


class WorkerSession:
    def __init__(self, address: DispatcherAddress, role: str, name: str, *, gpu: int | None = None):
        self.role = role
        self.name = name
        self.gpu = gpu
        self.node = address.node or socket.gethostname()
        self.endpoint = address.endpoint
        self.reconnect_s = address.reconnect_s  # how long an unanswered request is sent again
        self.held = HeldJobs()
        self.seen_grant = 0  # the grant number of the latest job received in this session
        self.channel = ControlChannel(self.endpoint, secret=address.secret,
                                      curve=client_from_config(address.curve), on_reply=self._on_reply, name=name)
        self.worker_id: str | None = None
        self.token: str | None = None
        self.registration: messages.RegisterReply | None = None
        self.stop_requested = threading.Event()

    # -- held jobs, kept current by the control channel's I/O thread ----------------------------
    def _on_reply(self, request: messages.Request, reply: messages.Reply) -> None:
        if getattr(request, "worker_id", None) != self.worker_id:
            return  # a late reply to a previous registration: its jobs went back with it
        if isinstance(reply, messages.GrantReply):
            if isinstance(request, messages.GetJob) and request.ready:  # the jobs it reported ready
                self.held.discard([report.job_id for report in request.ready])
            if reply.job is not None:
                self.held.add(reply.job.job_id)
                self.seen_grant = max(self.seen_grant, reply.job.grant)
        elif isinstance(request, _RELEASES):
            self.held.discard([request.job_id])
        elif isinstance(reply, messages.CommitReply):
            self.held.discard(request.job_ids)

    def _heartbeat(self) -> messages.Heartbeat | None:
        if self.worker_id is None:
            return None
        # Both are written on the I/O thread that calls this: a grant counted in seen_grant is listed
        # in holding unless the worker already reported or dropped it.
        return messages.Heartbeat(worker_id=self.worker_id, token=self.token, holding=self.held.snapshot(),
                                  seen_grant=self.seen_grant)

    # -- registration -------------------------------------------------------------------------
    def register(self, *, contract: CaptureContract | None = None,
                 model: messages.ModelClaim | None = None,
                 tp_ranks: list[messages.TargetRank] | None = None) -> messages.RegisterReply:
        """Register (retrying while the dispatcher starts or restarts) and start heartbeats.

        ``contract``: the capture contract the worker produces or expects; ``model``: a drafter's. A
        refusal (an incompatible contract, a model ahead of the ledger) raises ProtocolError.
        """
        self.worker_id = self.token = None
        self.held.clear()
        self.seen_grant = 0
        self.channel.set_heartbeat(None)
        try:  # unanswered: asked again 0.2 s later, unless asked to stop
            reply = resend_until_answered(
                lambda: self.channel.submit(messages.Register(
                    role=self.role, name=self.name, pid=os.getpid(), host=socket.gethostname(), node=self.node,
                    gpu=self.gpu, contract=contract, model=model, tp_ranks=tp_ranks)),
                lambda request_id: self.channel.result(request_id, timeout_s=CALL_TIMEOUT_S),
                again=lambda exc: 0.2 if isinstance(exc, DispatcherUnavailable) and not self.stop_requested.is_set()
                else None, deadline_s=self.reconnect_s)
        except DispatcherUnavailable:
            hint = ("; with CURVE on, check that curve.server_public_key is the dispatcher's and that the "
                    "public half of curve.client_secret_key is in its curve.allowed_client_keys (a refused "
                    "key gets no answer at all)") if self.channel.curve is not None else ""
            raise DispatcherGone(f"no dispatcher at {self.endpoint} for {self.reconnect_s:g}s "
                                 f"(dispatcher.reconnect_s){hint}") from None
        self.worker_id = reply.worker_id
        self.token = reply.token
        self.registration = reply
        self.channel.forget_silence()
        self.channel.set_heartbeat(reply.heartbeat_s, self._heartbeat)
        wall_s, cpu_s = since_process_start()
        log.info("%s registered as %s with run %s, %.1fs after the process started (%.1fs of CPU)", self.name,
                 self.worker_id, reply.run_id, wall_s, cpu_s)
        return reply

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: messages.WorkerRequest) -> int:
        """Send on this worker's behalf without waiting (pipelining); see :meth:`result`. What goes out
        is a copy of ``request`` naming this registration (worker id and token): a request sent again
        after the worker registered again names the new one."""
        return self.channel.submit(msgspec.structs.replace(request, worker_id=self.worker_id, token=self.token))

    def result(self, request_id: int, *, timeout_s: float = CALL_TIMEOUT_S) -> messages.Reply:
        """The reply to :meth:`submit`: WorkerLost when the dispatcher forgot us, NoReply when none
        came (the caller cannot tell what the dispatcher did with the request)."""
        try:
            return self.channel.result(request_id, timeout_s=timeout_s)
        except ProtocolError as exc:
            if exc.code == ErrorCode.UNKNOWN_WORKER:
                # every wait learns it, not only this one: a rank 0 whose commit was refused so (it was
                # declared dead while paused) then waits in the outcome's broadcast for a peer that left
                # the version, and would wait out drafter.collective_timeout_s with its beats stopped
                self.channel.forgotten()
                raise WorkerLost(exc.message) from None
            raise
        except DispatcherUnavailable as exc:
            raise NoReply(str(exc)) from None

    def done(self, request_id: int) -> bool:
        return self.channel.done(request_id)

    def call(self, request: messages.WorkerRequest, *, timeout_s: float = CALL_TIMEOUT_S) -> messages.Reply:
        return self.result(self.submit(request), timeout_s=timeout_s)

    def call_until_answered(self, request: messages.WorkerRequest, *,
                            timeout_s: float = CALL_TIMEOUT_S) -> messages.Reply:
        """An idempotent request, sent again while it gets no reply (up to ``dispatcher.reconnect_s``)."""
        try:
            return resend_until_answered(lambda: self.submit(request),
                                         lambda request_id: self.result(request_id, timeout_s=timeout_s),
                                         again=on_no_reply(log, "%s: %s got no reply; sending it again", self.name,
                                                           messages.op_of(request)),
                                         deadline_s=self.reconnect_s, wait_s=timeout_s)
        except NoReply:
            raise self.gone() from None

    def gone(self, what: str = "") -> DispatcherGone:
        """The error of a worker that asked for ``dispatcher.reconnect_s`` and got no answer."""
        return DispatcherGone(f"{what or 'no dispatcher at ' + self.endpoint} for {self.reconnect_s:g}s "
                              f"(dispatcher.reconnect_s)")

    def close_registration(self) -> None:
        """Leave (best effort): the dispatcher gives back at once whatever this registration held."""
        self.channel.set_heartbeat(None)
        if self.worker_id is not None:
            try:
                self.call(messages.Deregister(), timeout_s=2.0)
            except (ProtocolError, WorkerLost):
                pass
        self.worker_id = self.token = None
        self.held.clear()

    def close(self, *, deregister: bool = True) -> None:
        if deregister:
            self.close_registration()
        self.channel.close()


def since_process_start() -> tuple[float, float]:
    """Wall seconds since this process started, and the CPU seconds it has used (what its start-up
    costs, apart from waiting for a busy machine)."""
    import psutil
    process = psutil.Process()
    cpu = process.cpu_times()
    return time.time() - process.create_time(), cpu.user + cpu.system
