"""The socket floor under ``hsd bench scale``'s figures: a bare ZeroMQ echo answering the same
number of connections at the same request rate, and what it costs a request.

A step of the scale bench measures the dispatcher's CPU per request over real sockets. Part of it is
ours (decode, the core, the journal, encode) and part is what any Python process answering requests
over ZeroMQ pays on this host: the poller's wake-up, ``recv_multipart``, two ``send`` calls, and
ZeroMQ's I/O thread moving the bytes and waking the loop. The floor measures that part alone:

- :func:`echo_server` (a process of its own) is the dispatcher's loop with nothing inside: one
  ROUTER over ipc://, a ``zmq.Poller``, each wake-up drained (at most 256 messages) and every request
  answered at once with the same pre-encoded reply, sent as the dispatcher sends one (identity, then
  payload, plain int flags). It counts the requests it answered and its wake-ups.
- :func:`echo_clients` (``clients`` processes) hold the connections, one DEALER each, and send a
  pre-encoded ``get_job`` from every connection at the step's rate (one request in flight per
  connection, every connection starting at a random moment of its period, periods jittered ±10 %,
  as the scale bench's workers are), reading answers over epoll on the sockets' ``ZMQ_FD``.

The parent reads the echo's CPU from its threads' schedstat over a window after a warm-up, as the
scale bench reads the dispatcher's: ``floor_cpu_us_per_request`` (every thread), ``floor_loop_us_per_request``
(the loop thread), ``floor_io_us_per_request`` (ZeroMQ's I/O thread) and ``floor_requests_per_wakeup``.
Times the step's requests per item, it is the least CPU an item costs a Python loop over ZeroMQ at
that message count on this host: what no work inside the dispatcher can go below.
"""

from __future__ import annotations

import heapq
import multiprocessing
import random
import selectors
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from benchmarks.thread_cpu import cpu_ns_by_thread_name
from common.wire import messages

DRAIN_MAX = 256  # the dispatcher's bound per wake-up (dispatcher.server)
POLL_MS = 100
SWEEP_S = 1.0  # every connection is drained this often, in case an edge of its fd was missed
JITTER = 0.1
START_TIMEOUT_S = 60.0
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)


@dataclass(frozen=True)
class FloorPlan:
    endpoint: str
    connections: int
    requests_per_s: float  # over all connections
    clients: int = 2
    warmup_s: float = 1.0
    seconds: float = 5.0
    seed: int = 0


def request_bytes() -> bytes:
    """A target's ``get_job`` carrying one ready report, as the wire encodes it."""
    return messages.encode(messages.GetJob(id=12345, worker_id="w-0123456789", token="t" * 32, wait_ms=1000,
                                           ready=[messages.ReadyReport(job_id=123456, generation=1,
                                                                       busy_s=0.6)]))


def reply_bytes() -> bytes:
    """An empty grant, as the wire encodes it (the echo answers every request with it)."""
    return messages.encode(messages.GrantReply(id=12345, job=None, done=False))


def echo_server(endpoint: str, reply: bytes, counts: Any, ready: Any, stop: Any) -> None:
    """Answer every request on a ROUTER at once with ``reply``; ``counts`` = [requests, wake-ups]."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    ready.set()
    answered = wakeups = 0
    try:
        while not stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            wakeups += 1
            for _ in range(DRAIN_MAX):
                try:
                    frames = sock.recv_multipart(_NOBLOCK)
                except zmq.Again:
                    break
                try:
                    sock.send(frames[0], _SNDMORE_NOBLOCK)
                    sock.send(reply, _NOBLOCK)
                except zmq.ZMQError:
                    pass
                answered += 1
            counts[0], counts[1] = answered, wakeups  # two stores a wake-up: read by the parent at the window's ends
    finally:
        sock.close()
        ctx.term()


def echo_clients(plan: FloorPlan, index: int, request: bytes, started: Any, stop: Any) -> None:
    """This process's share of the connections, each sending ``request`` at its rate, one in flight;
    ``started`` is set once every connection of it is open."""
    rng = random.Random(plan.seed * 1000 + index)
    mine = range(index, plan.connections, plan.clients)
    period = len(mine) / (plan.requests_per_s * len(mine) / plan.connections) if mine else 1.0
    ctx = zmq.Context()
    selector = selectors.DefaultSelector()
    socks: list[zmq.Socket] = []
    in_flight: list[bool] = []
    due: list[tuple[float, int]] = []
    now = time.monotonic()
    for k in range(len(mine)):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(plan.endpoint)
        selector.register(sock.getsockopt(zmq.FD), selectors.EVENT_READ, k)
        socks.append(sock)
        in_flight.append(False)
        due.append((now + rng.random() * period, k))
    heapq.heapify(due)
    started.set()

    def drain(k: int) -> None:
        sock = socks[k]
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            sock.recv(_NOBLOCK)
            in_flight[k] = False

    next_sweep = now + SWEEP_S
    try:
        while not stop.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                at, k = heapq.heappop(due)
                if not in_flight[k]:
                    socks[k].send(request, _NOBLOCK)
                    in_flight[k] = True
                    drain(k)  # the fd signals edges: what a send leaves readable must be read now
                heapq.heappush(due, (at + period * rng.uniform(1 - JITTER, 1 + JITTER), k))
            timeout = max(0.0, min(due[0][0] if due else now + 0.1, next_sweep) - time.monotonic())
            for key, _ in selector.select(min(timeout, POLL_MS / 1000)):
                drain(key.data)
            if time.monotonic() >= next_sweep:
                for k in range(len(socks)):
                    drain(k)
                next_sweep = time.monotonic() + SWEEP_S
    finally:
        selector.close()
        for sock in socks:
            sock.close()
        ctx.term()


def measure_floor(plan: FloorPlan) -> dict[str, float]:
    """Run the echo and its clients, and the echo's CPU per request over the window (by thread name:
    ``loop``, ``ZMQbg/IO/0``, ...)."""
    ctx = multiprocessing.get_context("spawn")
    counts = ctx.Array("q", 2, lock=False)
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=echo_server, args=(plan.endpoint, reply_bytes(), counts, ready, stop),
                         name="hsd-bench-scale-floor-echo")
    clients: list[Any] = []
    server.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.2):
            if not server.is_alive():
                raise RuntimeError(f"the floor's echo exited with code {server.exitcode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the floor's echo did not start within {START_TIMEOUT_S:.0f}s")
        request = request_bytes()
        started = []
        for k in range(max(1, min(plan.clients, plan.connections))):
            started.append(ctx.Event())
            proc = ctx.Process(target=echo_clients, args=(plan, k, request, started[-1], stop),
                               name=f"hsd-bench-scale-floor-client-{k}")
            proc.start()
            clients.append(proc)
        for proc, event in zip(clients, started):  # the warm-up counts from every connection open
            while not event.wait(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not start within {START_TIMEOUT_S:.0f}s")
        time.sleep(plan.warmup_s)
        threads0, counts0, t0 = cpu_ns_by_thread_name(server.pid), tuple(counts), time.monotonic()
        time.sleep(plan.seconds)
        threads1, counts1, t1 = cpu_ns_by_thread_name(server.pid), tuple(counts), time.monotonic()
    finally:
        stop.set()
        for proc in [*clients, server]:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        Path(plan.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
    requests, wakeups = counts1[0] - counts0[0], counts1[1] - counts0[1]
    by_thread = {name: ns - threads0.get(name, 0) for name, ns in threads1.items()}
    per_request = (lambda ns: ns / 1e3 / requests) if requests else (lambda ns: float("nan"))
    return {"floor_requests_per_s": requests / (t1 - t0), "floor_connections": plan.connections,
            "floor_cpu_us_per_request": per_request(sum(by_thread.values())),
            "floor_loop_us_per_request": per_request(by_thread.get("loop", 0)),
            "floor_io_us_per_request": per_request(sum(ns for name, ns in by_thread.items()
                                                       if name.startswith("ZMQbg/IO"))),
            "floor_requests_per_wakeup": requests / wakeups if wakeups else float("nan")}
