"""A scripted protocol-v3 dispatcher for the worker loop's tests: real sockets and shared memory.

It hands out the jobs a test queued (slots it filled itself, for drafters), records every request
it receives with its arrival time, and misbehaves on cue (refuse, ignore or forget a commit). A
consumed report a get_hs carries is recorded too, once, as the ``consumed`` it stands for, right
after that get_hs. The worker under test runs its real loop in a thread of the test process.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from common.wire import messages
from common.run.config import Config, load_config
from common.wire.messages import ErrorCode, ProtocolError
from common.dataplane.shm_arena import SlotArena
from common.dataplane.slot_pattern import fill_pattern
from common.dataplane.slots import SlotLayout
from common.dataplane.transport import shm_transport_info

LAYOUT = SlotLayout(tokens_per_batch=64, num_layers=2, hidden_size=8, dtype="float32", max_seqs=4)


@dataclass
class Event:
    at: float
    op: str
    request: messages.Request
    carried: bool = False  # a report that came on a poll (consumed on a get_hs, job_ready on a get_job)


def make_job(job_id: int, slot: int, generation: int, *, lengths=(16, 12)) -> messages.Job:
    return messages.Job(job_id=job_id, epoch=0, bucket=0, seq_len=16, samples=list(range(len(lengths))),
                        lengths=list(lengths), num_tokens=sum(lengths), slot=slot, generation=generation)


def worker_config(run_dir, endpoint: str, *overrides: str) -> Config:
    return load_config(None, [f"run.dir={run_dir}", f"dispatcher.endpoint={endpoint}", "target.sim_cost_per_token=0",
                              "drafter.sim_cost_per_token=0", *overrides])


@contextlib.contextmanager
def running(loop) -> Iterator[threading.Thread]:
    """Run a worker loop in a thread for the block; then stop it, which must end it cleanly (exit 0)."""
    loop.poll_ms = 100
    thread = threading.Thread(target=lambda: setattr(loop, "exit_code", loop.run()), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        loop.request_stop()
        thread.join(10)
        assert not thread.is_alive() and loop.exit_code == 0


class FakeDispatcher:
    def __init__(self, endpoint: str, run_id: str, *, num_slots: int = 4, accum_steps: int = 1,
                 heartbeat_s: float = 0.05):
        self.endpoint = endpoint
        self.arena = SlotArena.create(run_id, LAYOUT, num_slots)
        self.accum_steps = accum_steps
        self.heartbeat_s = heartbeat_s
        self.jobs: deque[messages.Job] = deque()
        self.events: list[Event] = []
        self.commit_faults: deque[str] = deque()  # per commit_step: ok | refuse | silent | forget
        self.checkpoint_faults: deque[str] = deque()  # per checkpoint: ok | forget (the dispatcher restarted)
        self.model_steps: dict[str, int] = {}
        self.silent_polls = 0  # leave this many get_job/get_hs unanswered (a lost reply)
        self.min_poll_wait_s = 0.0  # a poll that finds nothing is answered no sooner, whatever its wait_ms
        self.flush = False  # answer a get_hs that found nothing with flush
        self.done = False
        self.workers: dict[str, str] = {}  # worker id -> token
        self._carried: set[tuple[str, int]] = set()  # (worker, job) consumed reports get_hs carried
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(5)

    # -- what tests use -----------------------------------------------------------------------
    def add_ready_job(self, job_id: int, slot: int, generation: int = 1) -> messages.Job:
        """A job whose slot already holds its pattern (what a target left for a drafter)."""
        job = make_job(job_id, slot, generation)
        fill_pattern(self.arena.slot(slot), job_id=job_id, generation=generation, bucket=0,
                     batch_size=len(job.lengths), seq_len=job.seq_len, seq_lens=job.lengths)
        self.add_job(job)
        return job

    def add_job(self, job: messages.Job) -> None:
        with self._lock:
            self.jobs.append(job)

    def ops(self, op: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.op == op]

    def holding_after(self, at: float) -> list[int] | None:
        """What the last heartbeat sent after ``at`` listed (None: no heartbeat since)."""
        beats = [e for e in self.ops("heartbeat") if e.at > at]
        return beats[-1].request.holding if beats else None

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                value = predicate(self)
            if value:
                return value
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}; events: {[e.request for e in self.events][-20:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.arena.close()
        self.arena.unlink()

    # -- the socket loop ----------------------------------------------------------------------
    def _serve(self) -> None:
        context = zmq.Context.instance()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._ready.set()
        parked: list[tuple[bytes, messages.GetJob | messages.GetHS, float]] = []
        try:
            while not self._stop.is_set():
                if sock.poll(10):
                    identity, frame = sock.recv_multipart()
                    try:
                        request = messages.decode_request(frame)
                    except ProtocolError as exc:
                        sock.send_multipart([identity, messages.encode(messages.error_reply(
                            exc.request_id, exc.code, exc.message))])
                        continue
                    with self._lock:
                        self._record(request)
                        reply = self._handle(request, parked, identity)
                    if reply is not None:
                        sock.send_multipart([identity, messages.encode(reply)])
                now = time.monotonic()
                for waiter in list(parked):
                    identity, request, deadline = waiter
                    with self._lock:
                        reply = self._poll_reply(request, final=now >= deadline)
                    if reply is not None:
                        parked.remove(waiter)
                        sock.send_multipart([identity, messages.encode(reply)])
        finally:
            sock.close(linger=0)

    def _record(self, request: messages.Request) -> None:
        at = time.monotonic()
        self.events.append(Event(at, messages.op_of(request), request))
        for job_id in getattr(request, "consumed", ()):
            if (request.worker_id, job_id) not in self._carried:  # a poll asked again carries it again
                self._carried.add((request.worker_id, job_id))
                report = messages.Consumed(id=request.id, worker_id=request.worker_id, token=request.token,
                                           job_id=job_id)
                self.events.append(Event(at, "consumed", report, carried=True))
        for ready in getattr(request, "ready", ()):
            if (request.worker_id, ready.job_id) not in self._carried:
                self._carried.add((request.worker_id, ready.job_id))
                report = messages.JobReady(id=request.id, worker_id=request.worker_id, token=request.token,
                                           job_id=ready.job_id, generation=ready.generation, busy_s=ready.busy_s)
                self.events.append(Event(at, "job_ready", report, carried=True))

    def _handle(self, request: messages.Request, parked: list, identity: bytes) -> messages.Reply | None:
        m, rid = messages, request.id
        if isinstance(request, m.Register):
            worker_id = f"{request.role[0]}{next(self._ids)}"
            self.workers[worker_id] = secrets.token_hex(8)
            model_step = None
            if request.model is not None:
                model_step = self.model_steps[request.model.id] = request.model.step  # rolled back to it
            return m.RegisterReply(id=rid, worker_id=worker_id, token=self.workers[worker_id], run_id="fake",
                                   transport=shm_transport_info(self.arena), heartbeat_s=self.heartbeat_s,
                                   worker_timeout_s=5.0, accum_steps=self.accum_steps, buckets=[16], epochs=1,
                                   contract=None, model_step=model_step)
        if not isinstance(request, m.WorkerRequest) or self.workers.get(request.worker_id) != request.token:
            return m.error_reply(rid, ErrorCode.UNKNOWN_WORKER, "not registered")
        if isinstance(request, (m.GetJob, m.GetHS)):
            if self.silent_polls:
                self.silent_polls -= 1
                return None
            reply = self._poll_reply(request, final=request.wait_ms == 0)
            if reply is None:
                parked.append((identity, request, time.monotonic() + max(request.wait_ms / 1000,
                                                                          self.min_poll_wait_s)))
            return reply
        if isinstance(request, m.CommitStep):
            fault = self.commit_faults.popleft() if self.commit_faults else "ok"
            if fault == "silent":
                return None
            if fault == "refuse":
                return m.error_reply(rid, ErrorCode.BAD_STATE, "a job of the step was given back")
            if fault == "forget":
                self.workers.clear()
                return m.error_reply(rid, ErrorCode.UNKNOWN_WORKER, "the dispatcher restarted")
            if request.step == self.model_steps.get(request.model, 0) + 1:
                self.model_steps[request.model] = request.step
            return m.CommitReply(id=rid, step=request.step, done=self.done)
        if isinstance(request, m.Checkpoint) and self.checkpoint_faults and self.checkpoint_faults.popleft() == "forget":
            self.workers.clear()
            return m.error_reply(rid, ErrorCode.UNKNOWN_WORKER, "the dispatcher restarted")
        if isinstance(request, m.Deregister):
            self.workers.pop(request.worker_id, None)
        return m.Done(id=rid, done=self.done) if isinstance(request, (m.Heartbeat, m.Checkpoint)) else m.Ack(id=rid)

    def _poll_reply(self, request: messages.GetJob | messages.GetHS, *, final: bool) -> messages.Reply | None:
        if self.workers.get(request.worker_id) != request.token:
            return messages.error_reply(request.id, ErrorCode.UNKNOWN_WORKER, "not registered")
        if self.jobs:
            return messages.GrantReply(id=request.id, job=self.jobs.popleft(), done=False)
        if self.done or final:
            return messages.GrantReply(id=request.id, job=None, done=self.done, flush=self.flush)
        return None
