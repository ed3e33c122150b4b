"""The dispatcher daemon: the socket loop around :class:`DispatcherCore`.

One thread, one poller over the control ROUTER and the read-only stats ROUTER. Every request is
answered with ``ok`` or a typed error; nothing a peer sends can stop the loop. Long-polls
(``get_job``/``get_hs``) are parked as waiters and retried after every state change, and answered
empty at their deadline: the loop sleeps in ``poll`` between events, never spins.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import zmq

from common.wire import protocol
from common.wire.client import run_id_for
from common.run.config import Config, write_resolved
from common.wire.protocol import ErrorCode, ProtocolError, field_of
from dispatcher.core import DispatcherCore
from common import faults
from common.wire.curve import HandshakeMonitor, ZapAuthorizer, auth_stats, server_from_config
from dispatcher.core_types import DONE, STEP_FULL, CoreOptions, Incompatible, Unauthorized, UnknownWorker, Worker
from dispatcher.groups import GroupChanged
from dispatcher.dataset import load_lengths
from dispatcher.journal import Journal, JournalFailed
from dispatcher.ledger import LedgerError
from dispatcher.metrics import MetricsServer
from dispatcher.pool import HSPool
from dispatcher.request_fields import (job_id_list, membership_of, poll_fields, rank_costs, register_fields, same_secret,
                                      step_metrics)
from dispatcher.rundir import STATE_FILE, check_endpoint, lock_run_dir, warn_about_changed_settings, write_state_file
from dispatcher.snapshot import build_snapshot, progress_line
from dispatcher.nodes import node_summary
from dispatcher.transport_setup import DataPlane

log = logging.getLogger("hsd.dispatcher")

SWEEP_INTERVAL_S = 0.25
PROGRESS_INTERVAL_S = 5.0
METRICS_INTERVAL_S = 1.0
MAX_WAIT_MS = 30_000
FAIL_CLOSED_EXIT_CODE = 3  # the journal failed: stopped, having acknowledged nothing that was not durable
HARD_MESSAGE_LIMIT = 64 << 20  # beyond this ZeroMQ drops the peer instead of buffering the message
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)


@dataclass
class Waiter:
    identity: bytes
    request_id: int
    op: str
    worker_id: str
    deadline: float
    fields: dict = field(default_factory=dict)  # the request's own (get_hs: membership; join_group: after, step)


class DispatcherServer:
    def __init__(self, config: Config):
        self.config = config
        self.run_dir = config.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for endpoint in (config.control_endpoint, config.stats_endpoint):
            check_endpoint(endpoint, config.dispatcher.secret, curve=config.curve.enabled,
                           multi_node=config.pool.transport == "nixl")
        self.curve = server_from_config(config.curve)
        self._lock = lock_run_dir(self.run_dir)
        warn_about_changed_settings(self.run_dir, config)
        write_resolved(config)
        self.run_id = run_id_for(self.run_dir)
        self.hostname = socket.gethostname()
        self.data_plane = DataPlane.create(config, self.run_id)
        self.journal = Journal(self.run_dir, sync_in_background=True)
        pool = HSPool(min_ready=config.pool.min_ready, target_credits=config.pool.target_credits,
                      pull=config.pool.pull, seed=config.run.seed, num_buckets=len(config.schedule.buckets),
                      locality=config.nodes.locality, remote_after_s=config.nodes.remote_after_s)
        now = time.monotonic()
        try:
            self.core = DispatcherCore(CoreOptions.from_config(config), run_dir=self.run_dir,
                                       lengths=load_lengths(config), journal=self.journal, pool=pool,
                                       shared_slots=self.data_plane.shared_slots, now=now)
        except Exception:
            self.data_plane.close()
            self.journal.close()
            self._lock.close()
            raise
        self.max_bytes = config.dispatcher.max_message_bytes
        self.waiters: list[Waiter] = []
        self.held_replies: list[tuple[int, bytes, dict]] = []  # (journal seq, identity, reply) until durable
        self._stop = False
        self._done_since: float | None = None
        self._next_progress = time.monotonic() + PROGRESS_INTERVAL_S
        self._last_progress_marker: tuple[int, int] | None = None
        self._context = zmq.Context()
        # The authorizer must listen before the first handshake: libzmq drops a CURVE connection
        # whose authentication request finds no handler.
        self.authorizer = ZapAuthorizer(self._context, self.curve.allowed) if self.curve else None
        self.control = self._bind(config.control_endpoint)
        self.stats = self._bind(config.stats_endpoint)
        self.handshakes = [HandshakeMonitor(self.control), HandshakeMonitor(self.stats)] if self.curve else []
        write_state_file(self.run_dir, {"pid": os.getpid(), "host": self.hostname, "run_id": self.run_id,
                                        "control": config.control_endpoint, "stats": config.stats_endpoint,
                                        "started": time.time()})
        self.metrics: MetricsServer | None = None
        self._next_metrics = 0.0
        if config.dispatcher.metrics_port:
            self.metrics = MetricsServer(config.dispatcher.metrics_host, config.dispatcher.metrics_port)
            log.info("Prometheus metrics on http://%s:%d/metrics", config.dispatcher.metrics_host, self.metrics.port)
        log.info("serving %s (stats %s), run %s, %s", config.control_endpoint, config.stats_endpoint,
                 self.run_id, self.data_plane.describe())
        if self.core.contract is not None:  # else the first worker that declares one sets it (logged then)
            log.info("capture contract of this run (from the target model's config.json): %s", self.core.contract)
        needed = config.target.count * config.pool.target_credits + config.pool.min_ready
        if self.data_plane.kind == "shm" and config.pool.slots < needed:
            log.warning("pool.slots=%d < target.count x pool.target_credits + pool.min_ready = %d: targets will "
                        "often wait for a free slot; raise pool.slots if memory allows", config.pool.slots, needed)

    def _bind(self, endpoint: str) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max(HARD_MESSAGE_LIMIT, 4 * self.max_bytes))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        if endpoint.startswith("ipc://"):
            Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)  # a stale socket file of a dead dispatcher
        sock.bind(endpoint)
        return sock

    # -- loop ---------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def serve_forever(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.stats, zmq.POLLIN)
        poller.register(self.journal.notify_fd, zmq.POLLIN)
        for monitor in self.handshakes:
            poller.register(monitor.socket, zmq.POLLIN)
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self.exit_code = 0
        try:
            while not self._stop:
                now = time.monotonic()
                wake = min([next_sweep] + [w.deadline for w in self.waiters])
                events = dict(poller.poll(max(0, int(1000 * (wake - now))) + 1))
                changed = False
                if self.control in events:
                    changed |= self._drain(self.control, self._handle_control)
                if self.stats in events:
                    self._drain(self.stats, self._handle_stats)
                for monitor in self.handshakes:
                    if monitor.socket in events:
                        monitor.drain()
                if self.journal.notify_fd in events:
                    self.journal.drain_notifications()
                    if self.journal.failed is not None:
                        raise JournalFailed(f"fsync of {self.journal.path} failed: {self.journal.failed}")
                    self._release_durable_replies()
                now = time.monotonic()
                if now >= next_sweep:
                    changed |= bool(self.core.sweep(now, self._is_alive))
                    next_sweep = now + SWEEP_INTERVAL_S
                    self.journal.flush()
                    self.core.maybe_snapshot()
                    changed = True  # a sweep may have freed slots, started an epoch or finished a build
                    if now >= self._next_progress:
                        self._log_progress(now)
                    if self.metrics is not None and now >= self._next_metrics:
                        self.metrics.update(self._stats_snapshot())
                        self._next_metrics = now + METRICS_INTERVAL_S
                    if self._finished(now):
                        break
                if changed:
                    self._serve_waiters(now)
                self._expire_waiters(now)
        except JournalFailed as exc:
            log.critical("%s. Stopping (fail closed): nothing that was not durable was acknowledged; workers keep "
                         "their state and register with the next dispatcher on this run directory.", exc)
            self.exit_code = FAIL_CLOSED_EXIT_CODE
        finally:
            self.close()
        return self.exit_code

    def _log_progress(self, now: float) -> None:
        """One line every few seconds while work moves, so a long run shows where it is."""
        self._next_progress = now + PROGRESS_INTERVAL_S
        core = self.core
        marker = (core.num_steps, core.ledger.num_pending)
        if marker == self._last_progress_marker:
            return
        self._last_progress_marker = marker
        log.info("%s", progress_line(core, self.config.run.epochs))

    def _finished(self, now: float) -> bool:
        if not (self.core.done and self.config.dispatcher.exit_when_done):
            return False
        if self._done_since is None:
            self._done_since = now
            log.info("all %d epoch(s) committed", self.config.run.epochs)
        grace = 2 * self.config.dispatcher.worker_timeout_s
        return not self.core.workers or now - self._done_since > grace

    def _drain(self, sock: zmq.Socket, handler) -> bool:
        changed = False
        for _ in range(256):  # bounded so the stats socket and sweeps are never starved
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            identity, payload = frames[0], frames[1:]
            reply, state_changed = handler(identity, payload)
            changed |= state_changed
            if reply is not None:
                self._send(sock, identity, reply)
        return changed

    def _send(self, sock: zmq.Socket, identity: bytes, reply: dict[str, Any]) -> None:
        try:  # send_multipart, with the flags as plain ints (pyzmq's flag enums cost Python calls per part)
            sock.send(identity, _SNDMORE_NOBLOCK)
            sock.send(protocol.pack(reply), _NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or its queue is full: nothing more to do
            log.debug("reply to a departed peer dropped: %s", exc)

    def _decode(self, payload: list[bytes]) -> protocol.Request:
        if len(payload) != 1:
            raise ProtocolError(ErrorCode.MALFORMED, f"expected one frame, got {len(payload)}")
        message = protocol.unpack(payload[0], self.max_bytes)
        request = protocol.parse_request(message)
        secret = self.config.dispatcher.secret
        if secret and not same_secret(message.get("secret"), secret):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong shared secret", request.id)
        return request

    def _handle_control(self, identity: bytes, payload: list[bytes]) -> tuple[dict | None, bool]:
        request_id = None
        try:
            request = self._decode(payload)
            request_id = request.id
            self.core.counters.requests[request.op] += 1
            if request.op == "stats":
                raise ProtocolError(ErrorCode.UNKNOWN_OP, "stats is served on the stats socket")
            return self._dispatch(identity, request)
        except ProtocolError as exc:
            return self._error(exc.request_id if exc.request_id is not None else request_id, exc.code, exc.message), False
        except UnknownWorker as exc:
            return self._error(request_id, ErrorCode.UNKNOWN_WORKER, f"worker {exc.args[0]} is not registered"), False
        except Unauthorized as exc:
            return self._error(request_id, ErrorCode.UNAUTHORIZED, str(exc)), False
        except Incompatible as exc:
            return self._error(request_id, ErrorCode.INCOMPATIBLE, str(exc)), False
        except GroupChanged as exc:
            return self._error(request_id, ErrorCode.GROUP_CHANGED, str(exc)), False
        except JournalFailed:
            raise  # fail closed: the loop stops the dispatcher
        except LedgerError as exc:
            return self._error(request_id, ErrorCode.BAD_STATE, str(exc)), False
        except Exception as exc:  # a bug must not take the run down with it
            log.exception("internal error")
            return self._error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False

    def _error(self, request_id: int | None, code: str, message: str) -> dict:
        self.core.counters.errors[code] += 1
        return protocol.error_reply(request_id, code, message)

    def _dispatch(self, identity: bytes, request: protocol.Request) -> tuple[dict | None, bool]:
        f, now, core = request.fields, time.monotonic(), self.core
        op = request.op
        if op == "register":
            return protocol.ok_reply(request.id, **self._register(f, now)), True
        worker_id = field_of(f, "worker_id", str)
        core.authenticate(worker_id, f.get("token"), now)
        if op == "heartbeat":
            holding = field_of(f, "holding", list)
            if not all(isinstance(j, int) and not isinstance(j, bool) for j in holding):
                raise ProtocolError(ErrorCode.MALFORMED, "holding must be a list of job ids")
            seen_grant = f.get("seen_grant")
            if seen_grant is not None and (not isinstance(seen_grant, int) or isinstance(seen_grant, bool)):
                raise ProtocolError(ErrorCode.MALFORMED, "seen_grant must be an integer")
            given_back = core.counters.given_back["not_held"]
            core.heartbeat(worker_id, now, holding, seen_grant)
            return protocol.ok_reply(request.id, done=core.done), core.counters.given_back["not_held"] != given_back
        if op in ("get_job", "get_hs", "join_group"):
            wait_ms = min(max(0, field_of(f, "wait_ms", int)), MAX_WAIT_MS)
            core.worker(worker_id, now)
            poll = poll_fields(op, f)
            if poll.get("failed"):  # a peer's collective failed: a dead rank must not be in the next version
                core.sweep(now, self._is_alive)
            reply = self._try_serve(op, request.id, worker_id, now, poll)
            if reply is None:
                if wait_ms == 0:
                    return self._empty_reply(op, request.id, worker_id), False
                # A worker asks again only after it gave up on its earlier poll: that one is dead.
                self.waiters = [w for w in self.waiters if (w.worker_id, w.op) != (worker_id, op)]
                self.waiters.append(Waiter(identity, request.id, op, worker_id, now + wait_ms / 1000, poll))
            return reply, reply is not None or op == "join_group"  # a join may open a version
        if op == "job_ready":
            core.job_ready(worker_id, field_of(f, "job_id", int), field_of(f, "generation", int),
                           float(field_of(f, "busy_s", (int, float))), now)
        elif op == "register_slots":
            if self.data_plane.kind not in ("cuda_ipc", "nixl"):
                raise ProtocolError(ErrorCode.INCOMPATIBLE, f"this run uses the {self.data_plane.kind} transport")
            core.register_slots(worker_id, field_of(f, "ipc_block", dict), field_of(f, "num_slots", int), now)
        elif op == "job_failed":
            core.job_failed(worker_id, field_of(f, "job_id", int), str(f.get("reason", "")), now)
        elif op == "consumed":
            core.consumed(worker_id, field_of(f, "job_id", int), now)
        elif op == "read_failed":
            core.read_failed(worker_id, field_of(f, "job_id", int), str(f.get("reason", "")), now)
        elif op == "commit_step":
            job_ids = job_id_list(f)
            step = core.commit_step(worker_id, job_ids, float(field_of(f, "busy_s", (int, float))), now,
                                    model=field_of(f, "model", str), step=field_of(f, "step", int),
                                    verified=int(f.get("verified") or 0), metrics=step_metrics(f.get("metrics")),
                                    sync_wait_s=float(f.get("sync_wait_s") or 0.0),
                                    step_s=float(f.get("step_s") or 0.0), membership=membership_of(f),
                                    **rank_costs(f))
            group = core.groups.group_of_rank(worker_id)
            extra = {"membership": group.version} if group is not None else {}
            reply = protocol.ok_reply(request.id, step=step, done=core.done, **extra)
            if faults.exit_before_commit_reply(self.run_dir, step):
                return self._when_durable(identity, reply, exit_once_durable=True), True
            return self._when_durable(identity, reply), True
        elif op == "step_outcome":
            committed = core.step_outcome(worker_id, now, model=field_of(f, "model", str),
                                          step=field_of(f, "step", int), job_ids=job_id_list(f),
                                          membership=field_of(f, "membership", int))
            return self._when_durable(identity, protocol.ok_reply(request.id, committed=committed,
                                                                  model_step=self._model_step(worker_id))), True
        elif op == "checkpoint":
            core.checkpoint(worker_id, field_of(f, "step", int), now, model=field_of(f, "model", str),
                            metrics=step_metrics(f.get("metrics")))
            return self._when_durable(identity, protocol.ok_reply(request.id, done=core.done)), True
        elif op == "deregister":
            self._drop_waiters(worker_id)
            core.deregister(worker_id, now)
        return protocol.ok_reply(request.id), True

    def _when_durable(self, identity: bytes, reply: dict, *, exit_once_durable: bool = False) -> dict | None:
        """A commit is acknowledged only once the journal's sync thread has it on disk.
        (``exit_once_durable``: the test fault of :func:`common.faults.exit_before_commit_reply`.)"""
        if not self.journal.unsynced and not exit_once_durable:
            return reply
        self.held_replies.append((self.journal.written_seq, identity, reply if not exit_once_durable else None))
        if not self.journal.unsynced:
            self._release_durable_replies()
        return None

    def _release_durable_replies(self) -> None:
        synced = self.journal.synced_seq
        ready = [held for held in self.held_replies if held[0] <= synced]
        self.held_replies = [held for held in self.held_replies if held[0] > synced]
        for _, identity, reply in ready:
            if reply is None:  # the test fault: the commit is on disk, its answer never goes out
                log.error("exiting with a commit durable and its reply not sent (%s)", faults.ENV)
                os._exit(9)
            self._send(self.control, identity, reply)

    def _register(self, f: dict, now: float) -> dict[str, Any]:
        fields = register_fields(f)
        role, model = fields["role"], fields["model"]
        self.data_plane.check_worker(role, f)
        worker = self.core.register(**fields, now=now)
        log.info("%s %s registered (%s pid %d on %s%s)", role, worker.id, worker.name, worker.pid, worker.host,
                 f", model {worker.model} at step {model.get('step', 0)}" if worker.model else "")
        c = self.config
        extra = ({"model_step": self.core.ledger.model_step.get(worker.model, 0),
                  "pending_committed": worker.pending_committed} if worker.model else {})
        if role == "drafter":  # its learning-rate schedule spans run.epochs of them
            extra["jobs_per_epoch"] = self.core.store.jobs_per_epoch
        return {"worker_id": worker.id, "token": worker.token, "contract": self.core.contract, **extra,
                "run_id": self.run_id, "transport": self.data_plane.info(role, worker.node),
                "heartbeat_s": c.dispatcher.heartbeat_s, "worker_timeout_s": c.dispatcher.worker_timeout_s,
                "accum_steps": c.drafter.accum_steps, "buckets": list(c.schedule.buckets),
                "epochs": c.run.epochs}

    def _try_serve(self, op: str, request_id: int, worker_id: str, now: float, fields: dict) -> dict | None:
        if op == "join_group":
            membership = self.core.join_group(worker_id, now, **fields)
            if membership is None:
                return None
            return protocol.ok_reply(request_id, group=membership.to_wire(), model_step=self._model_step(worker_id),
                                     membership=membership.version)
        if op == "get_job":
            grant = self.core.get_job(worker_id, now)
            flush = False
        else:
            grant, flush = self.core.get_hs(worker_id, now, **fields)
        if grant is None:
            return None
        if grant == DONE:
            return protocol.ok_reply(request_id, job=None, done=True, flush=True)
        if grant == STEP_FULL:
            # the step it speaks of: a reply that arrives once that step committed is stale
            return protocol.ok_reply(request_id, job=None, done=False, flush=False,
                                     step_full=self._model_step(worker_id) + 1)
        ipc = self.core.workers[grant.owner].ipc_block if grant.owner else None
        return protocol.ok_reply(request_id, job=grant.to_wire(ipc_block=ipc if op == "get_hs" else None),
                                 done=False, flush=flush)

    def _model_step(self, worker_id: str) -> int:
        worker = self.core.workers.get(worker_id)
        return self.core.ledger.model_step.get(worker.model, 0) if worker is not None and worker.model else 0

    def _empty_reply(self, op: str, request_id: int, worker_id: str) -> dict:
        if op == "join_group":  # membership: the version naming this rank now (0: it waits for one)
            named = self.core.workers[worker_id].group if worker_id in self.core.workers else None
            reload = self.core.checkpoint_to_load(worker_id) if worker_id in self.core.workers else None
            return protocol.ok_reply(request_id, group=None, model_step=self._model_step(worker_id),
                                     membership=named.version if named is not None else 0,
                                     **({"reload": reload} if reload is not None else {}))
        self.core.end_wait(worker_id, time.monotonic())
        flush = op == "get_hs" and self.core.nothing_left_to_hand_out()
        return protocol.ok_reply(request_id, job=None, done=self.core.done, flush=flush)

    def _serve_waiters(self, now: float) -> None:
        remaining = []
        for waiter in self.waiters:
            try:
                reply = self._try_serve(waiter.op, waiter.request_id, waiter.worker_id, now, waiter.fields)
            except UnknownWorker:
                reply = self._error(waiter.request_id, ErrorCode.UNKNOWN_WORKER, f"worker {waiter.worker_id} is not registered")
            except GroupChanged as exc:  # a parked get_hs of a rank whose group just changed: tell it now
                reply = self._error(waiter.request_id, ErrorCode.GROUP_CHANGED, str(exc))
            except LedgerError as exc:
                reply = self._error(waiter.request_id, ErrorCode.BAD_STATE, str(exc))
            if reply is None:
                remaining.append(waiter)
            else:
                self._send(self.control, waiter.identity, reply)
        self.waiters = remaining

    def _expire_waiters(self, now: float) -> None:
        if not self.waiters:
            return
        expired = [w for w in self.waiters if w.deadline <= now]
        if not expired:
            return
        self.waiters = [w for w in self.waiters if w.deadline > now]
        for waiter in expired:
            if waiter.worker_id not in self.core.workers:
                reply = self._error(waiter.request_id, ErrorCode.UNKNOWN_WORKER, f"worker {waiter.worker_id} is not registered")
            else:
                reply = self._empty_reply(waiter.op, waiter.request_id, waiter.worker_id)
            self._send(self.control, waiter.identity, reply)

    def _drop_waiters(self, worker_id: str) -> None:
        self.waiters = [w for w in self.waiters if w.worker_id != worker_id]

    def _is_alive(self, worker: Worker) -> bool:
        if worker.host != self.hostname:
            return True  # only heartbeats can tell for a remote worker
        try:  # a killed process its parent has not reaped yet is gone all the same
            return psutil.Process(worker.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    # -- stats ----------------------------------------------------------------------------------
    def _handle_stats(self, identity: bytes, payload: list[bytes]) -> tuple[dict | None, bool]:
        request_id = None
        try:
            request = self._decode(payload)
            request_id = request.id
            if request.op != "stats":
                raise ProtocolError(ErrorCode.READ_ONLY, f"the stats socket serves only 'stats', not {request.op!r}")
            return protocol.ok_reply(request_id, stats=self._stats_snapshot()), False
        except ProtocolError as exc:
            return self._error(exc.request_id if exc.request_id is not None else request_id, exc.code, exc.message), False
        except Exception as exc:  # a bug in the snapshot must not take the run down with it
            log.exception("internal error on the stats socket")
            return self._error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False

    def _stats_snapshot(self) -> dict[str, Any]:
        snapshot = build_snapshot(self.core, time.monotonic())
        snapshot.update(run_dir=str(self.run_dir), run_id=self.run_id, pid=os.getpid(),
                        transport=self.data_plane.describe_dict(), waiters=len(self.waiters),
                        auth=auth_stats(self.authorizer, self.handshakes, secret=bool(self.config.dispatcher.secret)),
                        nodes=node_summary(self.core.pool, self.core.workers, self.core.counters.reads,
                                           home=self.data_plane.node))
        return snapshot

    def close(self) -> None:
        for waiter in self.waiters:
            self._send(self.control, waiter.identity,
                       self._error(waiter.request_id, ErrorCode.UNKNOWN_WORKER, "the dispatcher is stopping"))
        self.waiters = []
        if self.journal.failed is None:
            from dispatcher.journal_events import DispatcherStopped
            self.journal.record(DispatcherStopped(done=self.core.done, peak_slots=self.core.pool.peak_in_use,
                                                  slot_bytes=self.data_plane.describe_dict()["slot_bytes"]))
        self.journal.close()  # its last fsync makes every held commit durable
        if self.journal.failed is None:
            self._release_durable_replies()
        else:  # never acknowledge what is not on disk: the worker retries with the next dispatcher
            for _, identity, reply in self.held_replies:
                self._send(self.control, identity, protocol.error_reply(
                    reply.get("id"), ErrorCode.INTERNAL, f"the journal failed ({self.journal.failed}); not durable"))
            self.held_replies = []
        self.core.close()
        for monitor, sock in zip(self.handshakes, (self.control, self.stats)):
            monitor.close(sock)
        self.control.close(linger=0)
        self.stats.close(linger=0)
        if self.authorizer is not None:
            self.authorizer.close()
        self._context.term()
        for endpoint in (self.config.control_endpoint, self.config.stats_endpoint):
            if endpoint.startswith("ipc://"):
                Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)
        if self.metrics is not None:
            self.metrics.close()
        self.data_plane.close()
        self._lock.close()
