"""A scripted protocol-v2 dispatcher for the worker loop's tests: real sockets and shared memory.

It hands out the jobs a test queued (slots it filled itself, for drafters), records every request
it receives with its arrival time, and misbehaves on cue (refuse, ignore or forget a commit). The
worker under test runs its real loop in a thread of the test process.
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
from typing import Any

import zmq

from common.wire import protocol
from common.run.config import Config, load_config
from common.wire.protocol import ErrorCode
from common.dataplane.shm_arena import SlotArena
from common.dataplane.slot_pattern import fill_pattern
from common.dataplane.slots import SlotLayout
from common.dataplane.transport import shm_transport_info

LAYOUT = SlotLayout(tokens_per_batch=64, num_layers=2, hidden_size=8, dtype="float32", max_seqs=4)


@dataclass
class Event:
    at: float
    op: str
    fields: dict[str, Any]


def make_job(job_id: int, slot: int, generation: int, *, lengths=(16, 12)) -> dict[str, Any]:
    return {"job_id": job_id, "epoch": 0, "slot": slot, "generation": generation, "bucket": 0,
            "samples": list(range(len(lengths))),
            "lengths": list(lengths), "seq_len": 16, "num_tokens": sum(lengths)}


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
        self.jobs: deque[dict[str, Any]] = deque()
        self.events: list[Event] = []
        self.commit_faults: deque[str] = deque()  # per commit_step: ok | refuse | silent | forget
        self.checkpoint_faults: deque[str] = deque()  # per checkpoint: ok | forget (the dispatcher restarted)
        self.model_steps: dict[str, int] = {}
        self.silent_polls = 0  # leave this many get_job/get_hs unanswered (a lost reply)
        self.flush = False  # answer a get_hs that found nothing with flush
        self.done = False
        self.workers: dict[str, str] = {}  # worker id -> token
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(5)

    # -- what tests use -----------------------------------------------------------------------
    def add_ready_job(self, job_id: int, slot: int, generation: int = 1) -> dict[str, Any]:
        """A job whose slot already holds its pattern (what a target left for a drafter)."""
        job = make_job(job_id, slot, generation)
        fill_pattern(self.arena.slot(slot), job_id=job_id, generation=generation, bucket=0,
                     batch_size=len(job["lengths"]), seq_len=job["seq_len"], seq_lens=job["lengths"])
        self.add_job(job)
        return job

    def add_job(self, job: dict[str, Any]) -> None:
        with self._lock:
            self.jobs.append(job)

    def ops(self, op: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.op == op]

    def holding_after(self, at: float) -> list[int] | None:
        """What the last heartbeat sent after ``at`` listed (None: no heartbeat since)."""
        beats = [e for e in self.ops("heartbeat") if e.at > at]
        return beats[-1].fields["holding"] if beats else None

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                value = predicate(self)
            if value:
                return value
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}; events: {[(e.op, e.fields) for e in self.events][-20:]}")

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
        parked: list[tuple[bytes, dict[str, Any], float]] = []
        try:
            while not self._stop.is_set():
                if sock.poll(10):
                    identity, frame = sock.recv_multipart()
                    message = protocol.unpack(frame)
                    with self._lock:
                        self.events.append(Event(time.monotonic(), message["op"], message))
                        reply = self._handle(message, parked, identity)
                    if reply is not None:
                        sock.send_multipart([identity, protocol.pack(reply)])
                now = time.monotonic()
                for waiter in list(parked):
                    identity, message, deadline = waiter
                    with self._lock:
                        reply = self._poll_reply(message, final=now >= deadline)
                    if reply is not None:
                        parked.remove(waiter)
                        sock.send_multipart([identity, protocol.pack(reply)])
        finally:
            sock.close(linger=0)

    def _handle(self, m: dict[str, Any], parked: list, identity: bytes) -> dict[str, Any] | None:
        op, rid = m["op"], m["id"]
        if op == "register":
            worker_id = f"{m['role'][0]}{next(self._ids)}"
            self.workers[worker_id] = secrets.token_hex(8)
            extra = {}
            if m.get("model"):
                self.model_steps[m["model"]["id"]] = m["model"]["step"]  # rolled back to it
                extra["model_step"] = m["model"]["step"]
            return protocol.ok_reply(rid, worker_id=worker_id, token=self.workers[worker_id], run_id="fake",
                                     transport=shm_transport_info(self.arena), heartbeat_s=self.heartbeat_s,
                                     worker_timeout_s=5.0, accum_steps=self.accum_steps, buckets=[16], epochs=1,
                                     contract=None, **extra)
        if self.workers.get(m.get("worker_id")) != m.get("token"):
            return protocol.error_reply(rid, ErrorCode.UNKNOWN_WORKER, "not registered")
        if op in ("get_job", "get_hs"):
            if self.silent_polls:
                self.silent_polls -= 1
                return None
            reply = self._poll_reply(m, final=m["wait_ms"] == 0)
            if reply is None:
                parked.append((identity, m, time.monotonic() + m["wait_ms"] / 1000))
            return reply
        if op == "commit_step":
            fault = self.commit_faults.popleft() if self.commit_faults else "ok"
            if fault == "silent":
                return None
            if fault == "refuse":
                return protocol.error_reply(rid, ErrorCode.BAD_STATE, "a job of the step was given back")
            if fault == "forget":
                self.workers.clear()
                return protocol.error_reply(rid, ErrorCode.UNKNOWN_WORKER, "the dispatcher restarted")
            model = m["model"]
            if m["step"] == self.model_steps.get(model, 0) + 1:
                self.model_steps[model] = m["step"]
            return protocol.ok_reply(rid, step=m["step"], done=self.done)
        if op == "checkpoint" and self.checkpoint_faults and self.checkpoint_faults.popleft() == "forget":
            self.workers.clear()
            return protocol.error_reply(rid, ErrorCode.UNKNOWN_WORKER, "the dispatcher restarted")
        if op == "deregister":
            self.workers.pop(m["worker_id"], None)
        return protocol.ok_reply(rid, done=self.done)

    def _poll_reply(self, m: dict[str, Any], *, final: bool) -> dict[str, Any] | None:
        if self.workers.get(m["worker_id"]) != m["token"]:
            return protocol.error_reply(m["id"], ErrorCode.UNKNOWN_WORKER, "not registered")
        if self.jobs:
            return protocol.ok_reply(m["id"], job=self.jobs.popleft(), done=False, flush=False)
        if self.done or final:
            return protocol.ok_reply(m["id"], job=None, done=self.done, flush=self.flush)
        return None
