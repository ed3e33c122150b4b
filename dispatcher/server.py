"""The dispatcher daemon: the socket loop around :class:`DispatcherCore`.

One thread, one poller over the control ROUTER and the read-only stats ROUTER. Every request is
decoded into its typed struct (:mod:`common.wire.messages`) and handed to the handler of its type;
every reply is a struct too, ``ok`` or a typed error: nothing a peer sends can stop the loop.
Long-polls (``get_job``/``get_hs``/``join_group``) wait in :mod:`dispatcher.long_polls`: the loop
sleeps in ``poll`` between events, never spins.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from common.wire import messages
from common.wire.client import run_id_for
from common.run.config import Config, ConfigError, write_resolved
from common.run.durable import STORAGE_FAILED_EXIT_CODE, StorageFailed
from common.wire.messages import ErrorCode, ProtocolError
from common.wire.stats_snapshot import Snapshot, serving_snapshot
from dispatcher.core import DispatcherCore
from common import faults
from common.wire.curve import HandshakeMonitor, ZapAuthorizer, auth_stats, server_from_config
from dispatcher.core_types import CoreOptions, Incompatible, Unauthorized, UnknownWorker
from dispatcher.groups import GroupChanged
from common.run.records.lengths import load_lengths
from dispatcher.journal import Journal, JournalFailed
from dispatcher.ledger import LedgerError
from dispatcher.liveness import ProcessWatch
from dispatcher.long_polls import LongPolls, counted_error, model_step
from dispatcher.metrics import MetricsServer
from dispatcher.pool import HSPool
from common.run.records.rundir import STATE_FILE, DispatcherState, check_free_space, write_state_file
from dispatcher.rundir import check_endpoint, lock_run_dir, warn_about_changed_settings
from dispatcher.snapshot import build_snapshot, progress_line
from dispatcher.nodes import node_summary
from dispatcher.transport_setup import DataPlane

log = logging.getLogger("hsd.dispatcher")

SWEEP_INTERVAL_S = 0.25
PROGRESS_INTERVAL_S = 5.0
METRICS_INTERVAL_S = 1.0
FAIL_CLOSED_EXIT_CODE = STORAGE_FAILED_EXIT_CODE  # the journal or a snapshot failed: stopped, having acknowledged nothing that was not durable
HARD_MESSAGE_LIMIT = 64 << 20  # beyond this ZeroMQ drops the peer instead of buffering the message
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)

Reply = messages.Reply
Handler = Callable[[Any, bytes, float], "Reply | None"]  # (the typed request, its sender, now)


class DispatcherServer:
    def __init__(self, config: Config):
        self.config = config
        self.run_dir = config.run_dir
        # The data is checked whole before anything is created: a bad dataset is refused naming its file.
        lengths = load_lengths(config.data, config.schedule, config.run)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for endpoint in (config.control_endpoint, config.stats_endpoint):
            check_endpoint(endpoint, config.dispatcher.secret, curve=config.curve.enabled,
                           multi_node=config.pool.transport == "nixl")
        self.curve = server_from_config(config.curve)
        self._lock = lock_run_dir(self.run_dir)
        try:
            check_free_space(self.run_dir, config.run.min_free_mb)
        except ConfigError:
            self._lock.close()
            raise
        warn_about_changed_settings(self.run_dir, config)
        write_resolved(config)
        self.run_id = run_id_for(self.run_dir)
        self.hostname = socket.gethostname()
        self.liveness = ProcessWatch(self.hostname)  # whether this host's workers' processes still run
        self.data_plane = DataPlane.create(config, self.run_id)
        self.journal = Journal(self.run_dir, sync_in_background=True)
        pool = HSPool(min_ready=config.pool.min_ready, target_credits=config.pool.target_credits,
                      pull=config.pool.pull, seed=config.run.seed, num_buckets=len(config.schedule.buckets),
                      locality=config.nodes.locality, remote_after_s=config.nodes.remote_after_s)
        now = time.monotonic()
        try:
            self.core = DispatcherCore(CoreOptions.from_config(config), run_dir=self.run_dir,
                                       lengths=lengths,
                                       journal=self.journal, pool=pool, shared_slots=self.data_plane.shared_slots,
                                       now=now)
        except Exception:
            self.data_plane.close()
            self.journal.close()
            self._lock.close()
            raise
        self.max_bytes = config.dispatcher.max_message_bytes
        self.held_replies: list[tuple[int, bytes, Reply | None]] = []  # (journal seq, identity, reply) until durable
        self._handlers = self._op_handlers()
        self._state_changed = False
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
        self.polls = LongPolls(self.core, lambda identity, reply: self._send(self.control, identity, reply))
        write_state_file(self.run_dir, DispatcherState(pid=os.getpid(), host=self.hostname, run_id=self.run_id,
                                                       control=config.control_endpoint, stats=config.stats_endpoint,
                                                       started=time.time()))
        self.metrics: MetricsServer | None = None
        self._next_metrics = 0.0
        if config.dispatcher.metrics_port:
            self.metrics = MetricsServer(config.dispatcher.metrics_host, config.dispatcher.metrics_port)
            log.info("Prometheus metrics on http://%s:%d/metrics", config.dispatcher.metrics_host, self.metrics.port)
        log.info("serving %s (stats %s), run %s, %s", config.control_endpoint, config.stats_endpoint,
                 self.run_id, self.data_plane.describe())
        if self.core.contract is not None:  # else the first worker that declares one sets it (logged then)
            log.info("capture contract of this run (from the target model's config.json): %s", self.core.contract.to_dict())
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
        process_ended_fd = self.liveness.fileno()
        if process_ended_fd is not None:
            poller.register(process_ended_fd, zmq.POLLIN)
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self.exit_code = 0
        try:
            while not self._stop:
                now = time.monotonic()
                wake = min(next_sweep, self.polls.next_deadline)
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
                        raise JournalFailed(self.journal.path, self.journal.failed, action="writing the journal")
                    self._release_durable_replies()
                now = time.monotonic()
                if process_ended_fd in events and self.liveness.collect():
                    next_sweep = now  # a worker's process ended: its jobs go back now
                if now >= next_sweep:
                    changed |= bool(self._sweep(now))
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
                    self.polls.serve(now)
                self.polls.expire(now)
        except StorageFailed as exc:
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

    def _send(self, sock: zmq.Socket, identity: bytes, reply: Reply) -> None:
        try:  # send_multipart, with the flags as plain ints (pyzmq's flag enums cost Python calls per part)
            sock.send(identity, _SNDMORE_NOBLOCK)
            sock.send(messages.encode(reply), _NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or its queue is full: nothing more to do
            log.debug("reply to a departed peer dropped: %s", exc)

    def _decode(self, payload: list[bytes]) -> messages.Request:
        if len(payload) != 1:
            raise ProtocolError(ErrorCode.MALFORMED, f"expected one frame, got {len(payload)}")
        request = messages.decode_request(payload[0], self.max_bytes)
        secret, given = self.config.dispatcher.secret, request.secret
        if secret and (given is None or not hmac.compare_digest(given.encode(), secret.encode())):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong shared secret", request.id)
        return request

    def _handle_control(self, identity: bytes, payload: list[bytes]) -> tuple[Reply | None, bool]:
        request_id = None
        try:
            request = self._decode(payload)
            request_id, op, now = request.id, messages.op_of(request), time.monotonic()
            self.core.counters.requests[op] += 1
            handler = self._handlers.get(type(request))
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_OP, f"{op} is served on the stats socket")
            if isinstance(request, messages.WorkerRequest):
                if not request.worker_id:
                    raise ProtocolError(ErrorCode.MALFORMED, f"{op}: missing field worker_id")
                self.core.authenticate(request.worker_id, request.token, now)
            self._state_changed = True  # a handler lowers it when nothing changed that a parked poll waits on
            return handler(request, identity, now), self._state_changed
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
        except StorageFailed:
            raise  # fail closed: the loop stops the dispatcher
        except LedgerError as exc:
            return self._error(request_id, ErrorCode.BAD_STATE, str(exc)), False
        except Exception as exc:  # a bug must not take the run down with it
            log.exception("internal error")
            return self._error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False

    def _error(self, request_id: int | None, code: str, message: str) -> messages.ErrorReply:
        return counted_error(self.core, request_id, code, message)

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
        c = self.config
        return messages.RegisterReply(
            id=request.id, worker_id=worker.id, token=worker.token, contract=core.contract, run_id=self.run_id,
            transport=self.data_plane.info(role, worker.node), heartbeat_s=c.dispatcher.heartbeat_s,
            worker_timeout_s=c.dispatcher.worker_timeout_s, accum_steps=c.drafter.accum_steps,
            buckets=list(c.schedule.buckets), epochs=c.run.epochs,
            model_step=core.ledger.model_step.get(worker.model, 0) if worker.model else None,
            pending_committed=worker.pending_committed,
            jobs_per_epoch=core.store.jobs_per_epoch if role == "drafter" else None)

    def _on_heartbeat(self, request: messages.Heartbeat, identity: bytes, now: float) -> messages.Done:
        given_back = self.core.counters.given_back["not_held"]
        worker = self.core.heartbeat(request.worker_id, now, request.holding, request.seen_grant, gpu=request.gpu,
                                     copies=request.copies)
        self._state_changed = self.core.counters.given_back["not_held"] != given_back
        return messages.Done(id=request.id, done=self.core.done,
                             membership=worker.group.version if worker.group is not None else 0)

    def _on_poll(self, request: messages.GetJob | messages.GetHS | messages.JoinGroup, identity: bytes,
                 now: float) -> Reply | None:
        self.core.worker(request.worker_id, now)
        joining = isinstance(request, messages.JoinGroup)
        if joining and request.failed:  # a peer's collective failed: a dead rank must not be in the next version
            self._sweep(now)
        reply, served = self.polls.poll(identity, request, now)
        self._state_changed = served or (reply is None and joining)  # a parked join may open a version
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
        return self._when_durable(identity, reply, exit_once_durable=faults.exit_before_commit_reply(self.run_dir, step))

    def _on_step_outcome(self, request: messages.StepOutcome, identity: bytes, now: float) -> Reply | None:
        committed = self.core.step_outcome(request.worker_id, now, model=request.model, step=request.step,
                                           job_ids=request.job_ids, membership=request.membership)
        return self._when_durable(identity, messages.OutcomeReply(
            id=request.id, committed=committed, model_step=model_step(self.core, request.worker_id)))

    def _on_checkpoint(self, request: messages.Checkpoint, identity: bytes, now: float) -> Reply | None:
        self.core.checkpoint(request.worker_id, request.step, now, model=request.model, metrics=request.metrics)
        return self._when_durable(identity, messages.Done(id=request.id, done=self.core.done))

    def _on_deregister(self, request: messages.Deregister, identity: bytes, now: float) -> messages.Ack:
        self.polls.drop(request.worker_id)
        self.core.deregister(request.worker_id, now)
        return messages.Ack(id=request.id)

    # -- replies held until the journal is durable -------------------------------------------
    def _when_durable(self, identity: bytes, reply: Reply, *, exit_once_durable: bool = False) -> Reply | None:
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

    def _sweep(self, now: float) -> list[str]:
        """The core's sweep, a same-host worker whose process ended counted dead (dispatcher.liveness)."""
        self.liveness.collect()
        dead = self.core.sweep(now, self.liveness.is_alive)
        self.liveness.forget_except(self.core.workers)
        return dead

    # -- stats ----------------------------------------------------------------------------------
    def _handle_stats(self, identity: bytes, payload: list[bytes]) -> tuple[Reply | None, bool]:
        request_id = None
        try:
            request = self._decode(payload)
            request_id = request.id
            if not isinstance(request, messages.Stats):
                raise ProtocolError(ErrorCode.READ_ONLY,
                                    f"the stats socket serves only 'stats', not {messages.op_of(request)!r}")
            return messages.StatsReply(id=request_id, stats=self._stats_snapshot()), False
        except ProtocolError as exc:
            return self._error(exc.request_id if exc.request_id is not None else request_id, exc.code, exc.message), False
        except Exception as exc:  # a bug in the snapshot must not take the run down with it
            log.exception("internal error on the stats socket")
            return self._error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False

    def _stats_snapshot(self) -> Snapshot:
        return serving_snapshot(
            build_snapshot(self.core, time.monotonic()), run_dir=str(self.run_dir), run_id=self.run_id,
            pid=os.getpid(), transport=self.data_plane.view(), waiters=len(self.polls.waiters),
            auth=auth_stats(self.authorizer, self.handshakes, secret=bool(self.config.dispatcher.secret)),
            nodes=node_summary(self.core.pool, self.core.workers, self.core.counters.reads, home=self.data_plane.node))

    def close(self) -> None:
        self.polls.close()
        if self.journal.failed is None:
            from common.run.records.events import DispatcherStopped
            self.journal.record(DispatcherStopped(done=self.core.done, peak_slots=self.core.pool.peak_in_use,
                                                  slot_bytes=self.data_plane.view().slot_bytes))
        self.journal.close()  # its last fsync makes every held commit durable
        if self.journal.failed is None:
            self._release_durable_replies()
        else:  # never acknowledge what is not on disk: the worker retries with the next dispatcher
            for _, identity, reply in self.held_replies:
                self._send(self.control, identity, messages.error_reply(
                    reply.id if reply is not None else None, ErrorCode.INTERNAL,
                    f"the journal failed ({self.journal.failed}); not durable"))
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
        self.liveness.close()
        self._lock.close()
