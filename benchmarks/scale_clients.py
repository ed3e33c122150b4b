"""The client processes of ``hsd bench scale``: many simulated targets and drafters in one process,
each with a DEALER socket of its own (one connection each, as real workers have), all driven by one
thread over epoll.

A simulated worker speaks the real protocol with the timing of the GPU model
(:class:`benchmarks.scale_model.GpuModel`) and no bytes: a target holds up to ``target_credits``
jobs, its next ``get_job`` in flight while its GPU works (``job_s`` a job, ±10 %), and reports each
ready on the ``get_job`` it sends as the job ends (protocol v4), or with a ``job_ready`` of its own
when a ``get_job`` is still in flight then; a drafter's ``get_hs`` carries the consumed report of the
slot it got before (protocol v3), it trains one micro-batch at a time (``1 / drafter_batches_per_s``) with one more waiting, and
commits every ``accum_steps`` micro-batches, one commit in flight. Every worker sends a heartbeat
on the same socket, listing the jobs it holds, when one is due every ``heartbeat_s`` and the worker
sent no request within the interval (as a real worker's control channel does:
:mod:`common.wire.heartbeats`).

``zmq.Poller`` walks every socket on every call (about 1 µs a socket); epoll over the sockets'
``ZMQ_FD`` costs nothing per idle socket. That fd signals edge-like: a socket is drained until
``EAGAIN`` whenever its fd fires and after it sent (once its handler is done), and a sweep over all sockets every
``SWEEP_S`` catches what a missed signal would leave behind (``late_wakeups`` counts what it found).
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import selectors
import time
from dataclasses import dataclass
from typing import Any

import zmq

from benchmarks.scale_model import GpuModel
from common.wire import messages
from common.wire.errors import ProtocolError
from common.wire.heartbeats import BeatSchedule

POLL_MS = 1000  # the long-poll a worker's get_job / get_hs waits (common.worker.loop's)
SWEEP_S = 1.0
JITTER = 0.1  # each job's GPU time is the model's x U(1 - JITTER, 1 + JITTER): GPUs drift apart, as real ones do


@dataclass(frozen=True)
class ClientPlan:
    endpoint: str
    secret: str
    targets: list[str]  # names
    drafters: list[str]
    model: GpuModel
    target_credits: int
    seed: int
    host: str  # the host the workers register from (see benchmarks.scale.ScaleOptions.same_host)


class Clock:
    """The process's timers: (due, seq, worker, what), earliest first; and the workers that sent
    since the loop last drained them (a handler never reads a reply in the middle of its own work)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Any, str]] = []
        self._seq = itertools.count()
        self.sent: set[Any] = set()

    def at(self, due: float, worker: Any, what: str) -> None:
        heapq.heappush(self.heap, (due, next(self._seq), worker, what))


class Recorder:
    """What a client measures inside the window [t0, t1): latency per op of the requests it sent
    then, and each heartbeat's lag (its reply's arrival after the moment it was due)."""

    def __init__(self) -> None:
        self.t0 = self.t1 = float("inf")
        self.latencies_ms: dict[str, list[float]] = {}
        self.heartbeat_lag_ms: list[float] = []
        self.errors: dict[str, int] = {}
        self.error_examples: dict[str, str] = {}  # code -> the first message of it
        self.late_wakeups = 0

    def inside(self, t: float) -> bool:
        return self.t0 <= t < self.t1

    def answered(self, op: str, sent: float, due: float | None, now: float) -> None:
        if self.inside(sent):
            self.latencies_ms.setdefault(op, []).append(1e3 * (now - sent))
            if due is not None:
                self.heartbeat_lag_ms.append(1e3 * (now - due))

    def error(self, op: str, code: str, message: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        self.error_examples.setdefault(code, f"{op}: {message}")


class SimWorker:
    """One simulated worker's connection and session: registration, request ids, held jobs, heartbeats."""

    def __init__(self, plan: ClientPlan, context: zmq.Context, role: str, name: str, clock: Clock,
                 recorder: Recorder, rng: random.Random):
        self.role, self.name, self.plan = role, name, plan
        self.clock, self.recorder, self.rng = clock, recorder, rng
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(plan.endpoint)
        self.fd = self.sock.getsockopt(zmq.FD)
        self.ids = itertools.count(1)
        self.pending: dict[int, tuple[messages.Request, float, float | None]] = {}  # id -> (request, sent, due)
        self.worker_id = ""
        self.token: str | None = None
        self.heartbeat_s = 0.0
        self.beats = BeatSchedule(0.0)
        self.last_request_at = float("-inf")  # a heartbeat due within heartbeat_s of it is skipped
        self.held: set[int] = set()
        self.seen_grant = 0
        self.lost = False

    # -- the wire ---------------------------------------------------------------------------------
    def send(self, request: messages.Request, now: float, due: float | None = None) -> None:
        request.id = next(self.ids)
        if self.plan.secret:
            request.secret = self.plan.secret
        if isinstance(request, messages.WorkerRequest):
            request.worker_id, request.token = self.worker_id, self.token
        self.pending[request.id] = (request, now, due)
        if not isinstance(request, messages.Heartbeat):
            self.last_request_at = now
        self.sock.send(messages.encode(request), zmq.NOBLOCK)
        self.clock.sent.add(self)  # a send may consume the fd's signal of a reply already queued: drained next

    def drain(self, now: float) -> int:
        """Every reply queued on the socket, until its fd is clear: reading ZMQ_EVENTS clears the fd,
        and a reply that arrived since the last recv shows there (its signal is gone with it)."""
        received = 0
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return received
                continue
            received += 1
            self.on_frame(frame, time.monotonic())

    def on_frame(self, frame: bytes, now: float) -> None:
        entry = self.pending.pop(messages.reply_id(frame), None)
        if entry is None:
            return
        request, sent, due = entry
        op = messages.op_of(request)
        try:
            reply = messages.decode_reply(frame, op)
        except ProtocolError as exc:
            self.recorder.error(op, exc.code, exc.message)
            if exc.code == messages.ErrorCode.UNKNOWN_WORKER:
                self.lost = True
            return
        self.recorder.answered(op, sent, due, now)
        if isinstance(reply, messages.GrantReply) and reply.job is not None:
            self.held.add(reply.job.job_id)
            self.seen_grant = max(self.seen_grant, reply.job.grant)
        self.on_reply(request, reply, now)

    # -- the session ------------------------------------------------------------------------------
    def register(self, now: float) -> None:
        model = messages.ModelClaim(id=self.name, step=0) if self.role == "drafter" else None
        self.send(messages.Register(role=self.role, name=self.name, pid=os.getpid(),
                                    host=self.plan.host, model=model), now)

    def on_registered(self, reply: messages.RegisterReply, now: float) -> None:
        """Heartbeats and work begin at a random moment within one period of each: workers that
        registered together do not move in step (a burst of a thousand would be this bench's own)."""
        self.worker_id, self.token, self.heartbeat_s = reply.worker_id, reply.token, reply.heartbeat_s
        self.beats = BeatSchedule(reply.heartbeat_s)
        self.setup(reply)
        self.clock.at(now + self.rng.uniform(0, self.heartbeat_s), self, "heartbeat")
        self.clock.at(now + self.rng.uniform(0, self.gpu_s()), self, "begin")

    def gpu_s(self) -> float:
        """Seconds of GPU time of the next job or micro-batch."""
        period = self.plan.model.job_s if self.role == "target" else 1.0 / self.plan.model.drafter_batches_per_s
        return period * self.rng.uniform(1 - JITTER, 1 + JITTER)

    def on_timer(self, what: str, due: float, now: float) -> None:
        if self.lost:
            return
        if what == "heartbeat":
            if self.beats.goes_out(now, self.last_request_at):
                self.send(messages.Heartbeat(holding=sorted(self.held), seen_grant=self.seen_grant), now, due)
            self.clock.at(due + self.heartbeat_s, self, "heartbeat")
        elif what == "begin":
            self.poll(now)
        else:
            self.gpu_done(now)

    def on_reply(self, request: messages.Request, reply: messages.Reply, now: float) -> None:
        if isinstance(reply, messages.RegisterReply):
            self.on_registered(reply, now)
        else:
            self.answered(request, reply, now)

    @property
    def registered(self) -> bool:
        return bool(self.worker_id)

    def close(self) -> None:
        self.sock.close(linger=0)

    # the role's own
    def setup(self, reply: messages.RegisterReply) -> None: ...
    def poll(self, now: float) -> None: ...
    def answered(self, request: messages.Request, reply: messages.Reply, now: float) -> None: ...
    def gpu_done(self, now: float) -> None: ...


class ScaleTarget(SimWorker):
    def setup(self, reply: messages.RegisterReply) -> None:
        self.queue: list[messages.Job] = []  # granted, not yet finished; the first is on the GPU
        self.ready: list[messages.ReadyReport] = []  # finished, for the next get_job to report
        self.polling = False
        self.done = False

    def poll(self, now: float) -> None:
        if not self.polling and not self.done and len(self.queue) < self.plan.target_credits:
            self.polling = True
            ready, self.ready = self.ready, []
            self.send(messages.GetJob(wait_ms=POLL_MS, ready=ready), now)

    def answered(self, request: messages.Request, reply: messages.Reply, now: float) -> None:
        if isinstance(request, messages.JobReady):
            self.held.discard(request.job_id)
        elif isinstance(reply, messages.GrantReply):
            self.held.difference_update(r.job_id for r in request.ready)
            self.polling = False
            self.done = reply.done
            if reply.job is not None:
                self.queue.append(reply.job)
                if len(self.queue) == 1:
                    self.clock.at(now + self.gpu_s(), self, "gpu")
            self.poll(now)

    def gpu_done(self, now: float) -> None:
        job = self.queue.pop(0)
        report = messages.ReadyReport(job_id=job.job_id, generation=job.generation, busy_s=self.plan.model.job_s)
        if self.queue:
            self.clock.at(now + self.gpu_s(), self, "gpu")
        if self.polling or self.done:  # no get_job goes out now: the report goes alone
            self.send(messages.JobReady(job_id=report.job_id, generation=report.generation, busy_s=report.busy_s), now)
        else:
            self.ready.append(report)
            self.poll(now)


class ScaleDrafter(SimWorker):
    def setup(self, reply: messages.RegisterReply) -> None:
        self.accum = reply.accum_steps
        self.step = reply.model_step or 0
        self.queue: list[int] = []  # job ids granted, not yet trained; the first is on the GPU
        self.carried: list[int] = []  # copied out, reported consumed by the next get_hs
        self.window: list[int] = []  # trained, not yet committed
        self.committing: list[int] | None = None
        self.committed: list[int] = []
        self.polling = False

    def poll(self, now: float) -> None:
        if not self.polling and len(self.queue) < 2:
            self.polling = True
            consumed, self.carried = self.carried, []
            self.send(messages.GetHS(wait_ms=POLL_MS, consumed=consumed), now)

    def commit(self, now: float, *, partial: bool = False) -> None:
        if self.committing is None and self.window and (partial or len(self.window) >= self.accum):
            self.committing, self.window = self.window, []
            self.send(messages.CommitStep(model=self.name, step=self.step + 1, job_ids=self.committing,
                                          busy_s=len(self.committing) / self.plan.model.drafter_batches_per_s), now)

    def answered(self, request: messages.Request, reply: messages.Reply, now: float) -> None:
        if isinstance(reply, messages.CommitReply):
            self.step = reply.step
            self.held.difference_update(request.job_ids)
            self.committed.extend(request.job_ids)
            self.committing = None
            self.commit(now)
        elif isinstance(reply, messages.GrantReply):
            self.polling = False
            if reply.job is not None:
                self.carried.append(reply.job.job_id)  # the copy out takes no time here
                self.queue.append(reply.job.job_id)
                if len(self.queue) == 1:
                    self.clock.at(now + self.gpu_s(), self, "gpu")
            if reply.flush:
                self.commit(now, partial=True)
            self.poll(now)

    def gpu_done(self, now: float) -> None:
        self.window.append(self.queue.pop(0))
        if self.queue:
            self.clock.at(now + self.gpu_s(), self, "gpu")
        self.poll(now)  # its consumed report goes out before any commit that names the job
        self.commit(now)


def run_clients(plan: ClientPlan, control: Any) -> None:
    """A client process: register every worker, say so on ``control`` (a Pipe end), run until told
    to stop, then send back what was measured. ``control`` brings ``("window", t0, t1)`` and
    ``("stop",)``."""
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 2 * (len(plan.targets) + len(plan.drafters)) + 64)
    clock, recorder, rng = Clock(), Recorder(), random.Random(plan.seed)
    workers: list[SimWorker] = [ScaleTarget(plan, context, "target", n, clock, recorder, rng) for n in plan.targets]
    workers += [ScaleDrafter(plan, context, "drafter", n, clock, recorder, rng) for n in plan.drafters]
    selector = selectors.EpollSelector()
    for worker in workers:
        selector.register(worker.fd, selectors.EVENT_READ, worker)
    selector.register(control.fileno(), selectors.EVENT_READ, None)
    try:
        now = time.monotonic()
        for worker in workers:
            worker.register(now)
        announced, stopping, next_sweep = False, False, now + SWEEP_S
        while not stopping:
            now = time.monotonic()
            wake = min(next_sweep, clock.heap[0][0] if clock.heap else next_sweep)
            for key, _ in selector.select(max(0.0, wake - now)):
                if key.data is None:
                    message = control.recv()
                    if message[0] == "window":
                        recorder.t0, recorder.t1 = message[1], message[2]
                    else:
                        stopping = True
                else:
                    key.data.drain(now)
            now = time.monotonic()
            while clock.heap and clock.heap[0][0] <= now:
                due, _, worker, what = heapq.heappop(clock.heap)
                worker.on_timer(what, due, now)
            while clock.sent:
                clock.sent.pop().drain(now)
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                recorder.late_wakeups += sum(worker.drain(now) for worker in workers)
                if not announced and all(worker.registered for worker in workers):
                    announced = True
                    control.send(("registered", len(workers)))
        committed = [job for w in workers if isinstance(w, ScaleDrafter) and w.registered for job in w.committed]
        control.send(("result", {"latencies_ms": recorder.latencies_ms, "heartbeat_lag_ms": recorder.heartbeat_lag_ms,
                                 "errors": recorder.errors, "error_examples": recorder.error_examples, "late_wakeups": recorder.late_wakeups,
                                 "committed": committed, "lost": sum(w.lost for w in workers)}))
    finally:
        selector.close()
        for worker in workers:
            worker.close()
        context.term()
