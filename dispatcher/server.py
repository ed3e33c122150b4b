"""The dispatcher daemon's socket loop around :class:`DispatcherCore`.

One thread, one poller over the control ROUTER and the read-only stats ROUTER. Every request is
decoded into its typed struct (:mod:`common.wire.messages`) and handed to the handlers
(:mod:`dispatcher.handlers`); every reply is a struct too, ``ok`` or a typed error: nothing a peer
sends can stop the loop. Long-polls (``get_job``/``get_hs``/``join_group``) wait in
:mod:`dispatcher.long_polls`: the loop sleeps in ``poll`` between events, never spins. A reply that
acknowledges journal lines waits in :class:`DurableReplies` until they are on disk. What the loop
serves is built by :func:`dispatcher.build.build_dispatcher`.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import zmq

from common import faults
from common.run.config import DispatcherSection, RunSection
from common.run.durable import STORAGE_FAILED_EXIT_CODE, StorageFailed
from common.run.records.events import DispatcherStopped
from common.wire import messages
from common.wire.messages import ErrorCode, ProtocolError
from common.wire.stats_snapshot import Snapshot
from dispatcher.auth import CurveAuth
from dispatcher.core import DispatcherCore
from dispatcher.handlers import ControlHandlers, StatsView
from dispatcher.journal import Journal, JournalFailed
from dispatcher.liveness import ProcessWatch
from dispatcher.long_polls import LongPolls, counted_error
from dispatcher.loop_cpu import LoopCpu
from dispatcher.metrics import MetricsServer
from dispatcher.snapshot import progress_line

log = logging.getLogger("hsd.dispatcher")

SWEEP_INTERVAL_S = 0.25
PROGRESS_INTERVAL_S = 5.0
METRICS_INTERVAL_S = 1.0
SNAPSHOT_WORKERS_A_STEP = 256  # a snapshot's workers built between two turns of the loop (~1-2 ms)
FAIL_CLOSED_EXIT_CODE = STORAGE_FAILED_EXIT_CODE  # the journal or a snapshot failed: stopped, having acknowledged nothing that was not durable
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)

Reply = messages.Reply


def send_reply(sock: zmq.Socket, identity: bytes, reply: Reply) -> None:
    try:  # send_multipart, with the flags as plain ints (pyzmq's flag enums cost Python calls per part)
        sock.send(identity, _SNDMORE_NOBLOCK)
        sock.send(messages.encode(reply), _NOBLOCK)
    except zmq.ZMQError as exc:  # the peer is gone or its queue is full: nothing more to do
        log.debug("reply to a departed peer dropped: %s", exc)


class DurableReplies:
    """The durable-reply gate: a commit is acknowledged only once the journal's sync thread has it
    on disk. A reply held here goes out when the journal reports its lines synced; if the journal
    fails instead, the worker gets an error and retries with the next dispatcher."""

    def __init__(self, journal: Journal, send: Callable[[bytes, Reply], None]):
        self.journal = journal
        self.send = send  # to the control socket
        self.held: list[tuple[int, bytes, Reply | None]] = []  # (journal seq, identity, reply) until durable

    def when_durable(self, identity: bytes, reply: Reply, *, exit_once_durable: bool = False) -> Reply | None:
        """The reply to send now, or None when it is held.
        (``exit_once_durable``: the test fault of :func:`common.faults.exit_before_commit_reply`.)"""
        if not self.journal.unsynced and not exit_once_durable:
            return reply
        self.held.append((self.journal.written_seq, identity, reply if not exit_once_durable else None))
        if not self.journal.unsynced:
            self.release()
        return None

    def release(self) -> None:
        synced = self.journal.synced_seq
        ready = [held for held in self.held if held[0] <= synced]
        self.held = [held for held in self.held if held[0] > synced]
        for _, identity, reply in ready:
            if reply is None:  # the test fault: the commit is on disk, its answer never goes out
                log.error("exiting with a commit durable and its reply not sent (%s)", faults.ENV)
                os._exit(9)
            self.send(identity, reply)

    def close(self) -> None:
        """Once the journal is closed (its last fsync makes every held commit durable)."""
        if self.journal.failed is None:
            self.release()
            return
        for _, identity, reply in self.held:  # never acknowledge what is not on disk
            self.send(identity, messages.error_reply(reply.id if reply is not None else None, ErrorCode.INTERNAL,
                                                     f"the journal failed ({self.journal.failed}); not durable"))
        self.held = []


@dataclass(frozen=True, eq=False)
class SnapshotBuild:
    """A stats snapshot the loop builds a step a turn (:meth:`StatsView.snapshot_steps`), serving
    requests in between, and what it is for: ``done`` takes the snapshot, ``failed`` the error a
    bug in building it raised."""

    steps: Generator[None, None, Snapshot]
    done: Callable[[Snapshot], None]
    failed: Callable[[Exception], None]


@dataclass(frozen=True)
class LoopOptions:
    max_message_bytes: int
    secret: str  # dispatcher.secret: every request must carry it (empty: none)
    exit_when_done: bool  # stop once every epoch is committed and the workers left
    worker_timeout_s: float  # after the last epoch, workers still registered are waited for twice this
    epochs: int

    @classmethod
    def of(cls, dispatcher: DispatcherSection, run: RunSection) -> "LoopOptions":
        return cls(max_message_bytes=dispatcher.max_message_bytes, secret=dispatcher.secret,
                   exit_when_done=dispatcher.exit_when_done,
                   worker_timeout_s=dispatcher.worker_timeout_s, epochs=run.epochs)


class DispatcherServer:
    def __init__(self, core: DispatcherCore, *, options: LoopOptions, context: zmq.Context, control: zmq.Socket,
                 stats: zmq.Socket, auth: CurveAuth, handlers: ControlHandlers, stats_view: StatsView,
                 polls: LongPolls, replies: DurableReplies, journal: Journal, liveness: ProcessWatch,
                 metrics: MetricsServer | None, slot_bytes: int, loop_cpu: LoopCpu, release: Callable[[], None]):
        self.core = core
        self.options = options
        self.control = control
        self.stats = stats
        self.auth = auth
        self.handlers = handlers
        self.stats_view = stats_view
        self.polls = polls
        self.replies = replies
        self.journal = journal
        self.liveness = liveness
        self.metrics = metrics
        self.slot_bytes = slot_bytes  # for the journal's last line
        self.loop_cpu = loop_cpu  # this thread's CPU by what it was spent on (dispatcher/loop_cpu.py)
        self._op = "refused"  # the op of the control request being answered (what its CPU is booked to)
        self._context = context
        self._release = release  # what the composition root holds: files, the slot memory, the run-dir lock
        self._stop = False
        self._done_since: float | None = None
        self._next_progress = time.monotonic() + PROGRESS_INTERVAL_S
        self._last_progress_marker: tuple[int, int] | None = None
        self._next_metrics = 0.0
        self._builds: list[SnapshotBuild] = []  # snapshots being built: each stats request's, /metrics'
        self._metrics_build: SnapshotBuild | None = None  # the last /metrics build (in _builds until done)

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
        for monitor in self.auth.handshakes:
            poller.register(monitor.socket, zmq.POLLIN)
        process_ended_fd = self.liveness.fileno()
        if process_ended_fd is not None:
            poller.register(process_ended_fd, zmq.POLLIN)
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self.exit_code = 0
        charge = self.loop_cpu.charge
        try:
            while not self._stop:
                now = time.monotonic()
                wake = min(next_sweep, self.polls.next_deadline) if not self._builds else now
                events = dict(poller.poll(max(0, int(1000 * (wake - now))) + 1))
                self.loop_cpu.woke()
                changed = False
                if self.control in events:
                    changed |= self._drain(self.control, self._handle_control)
                if self.stats in events:
                    self._drain(self.stats, self._handle_stats, charge_as="stats")
                for monitor in self.auth.handshakes:
                    if monitor.socket in events:
                        monitor.drain()
                        charge("durable")
                if self.journal.notify_fd in events:
                    self.journal.drain_notifications()
                    if self.journal.failed is not None:
                        raise JournalFailed(self.journal.path, self.journal.failed, action="writing the journal")
                    self.replies.release()
                    charge("durable")
                now = time.monotonic()
                if process_ended_fd in events and self.liveness.collect():
                    next_sweep = now  # a worker's process ended: its jobs go back now
                if now >= next_sweep:
                    changed |= bool(self.handlers.sweep(now))
                    next_sweep = now + SWEEP_INTERVAL_S
                    self.journal.flush()
                    self.core.maybe_snapshot()
                    changed = True  # a sweep may have freed slots, started an epoch or finished a build
                    if now >= self._next_progress:
                        self._log_progress(now)
                    if (self.metrics is not None and now >= self._next_metrics
                            and self._metrics_build not in self._builds):  # one /metrics build at a time
                        self._start_metrics()
                        self._next_metrics = now + METRICS_INTERVAL_S
                    charge("sweep")
                    if self._finished(now):
                        break
                if self._builds:
                    self._build_step()
                    charge("stats")
                if changed:
                    self.polls.serve(now)
                charge("serve")
                self.polls.expire(now)
                charge("expire")
        except StorageFailed as exc:
            log.critical("%s. Stopping (fail closed): nothing that was not durable was acknowledged; workers keep "
                         "their state and register with the next dispatcher on this run directory.", exc)
            self.exit_code = FAIL_CLOSED_EXIT_CODE
        finally:
            self.close()
        return self.exit_code

    def _build_step(self) -> None:
        """One step of each snapshot being built; a finished one goes where it was asked for."""
        for build in list(self._builds):
            try:
                next(build.steps)
            except StopIteration as built:
                self._builds.remove(build)
                build.done(built.value)
            except Exception as exc:  # a bug in the snapshot must not take the run down with it
                self._builds.remove(build)
                log.exception("internal error building a stats snapshot")
                build.failed(exc)

    def _start_metrics(self) -> None:
        """Build the /metrics snapshot in steps; the last hands it to the HTTP thread."""
        assert self.metrics is not None
        self._metrics_build = SnapshotBuild(self._snapshot_steps(), done=self.metrics.update, failed=lambda _: None)
        self._builds.append(self._metrics_build)

    def _snapshot_steps(self) -> Generator[None, None, Snapshot]:
        return self.stats_view.snapshot_steps(workers_a_step=SNAPSHOT_WORKERS_A_STEP)

    def _log_progress(self, now: float) -> None:
        """One line every few seconds while work moves, so a long run shows where it is."""
        self._next_progress = now + PROGRESS_INTERVAL_S
        core = self.core
        marker = (core.num_steps, core.ledger.num_pending)
        if marker == self._last_progress_marker:
            return
        self._last_progress_marker = marker
        log.info("%s", progress_line(core, self.options.epochs))

    def _finished(self, now: float) -> bool:
        if not (self.core.done and self.options.exit_when_done):
            return False
        if self._done_since is None:
            self._done_since = now
            log.info("all %d epoch(s) committed", self.options.epochs)
        grace = 2 * self.options.worker_timeout_s
        return not self.core.workers or now - self._done_since > grace

    def _drain(self, sock: zmq.Socket, handler, *, charge_as: str | None = None) -> bool:
        """Answer what waits on ``sock``; each message's CPU is booked to ``charge_as`` (None: its op)."""
        changed = False
        charge = self.loop_cpu.charge
        for _ in range(256):  # bounded so the stats socket and sweeps are never starved
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            identity, payload = frames[0], frames[1:]
            reply, state_changed = handler(identity, payload)
            changed |= state_changed
            if reply is not None:
                send_reply(sock, identity, reply)
            charge(charge_as or self._op)
        return changed

    def _decode(self, payload: list[bytes]) -> messages.Request:
        if len(payload) != 1:
            raise ProtocolError(ErrorCode.MALFORMED, f"expected one frame, got {len(payload)}")
        request = messages.decode_request(payload[0], self.options.max_message_bytes)
        secret, given = self.options.secret, request.secret
        if secret and (given is None or not hmac.compare_digest(given.encode(), secret.encode())):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong shared secret", request.id)
        return request

    def _handle_control(self, identity: bytes, payload: list[bytes]) -> tuple[Reply | None, bool]:
        self._op = "refused"  # not decoded, or without the run's secret
        try:
            request = self._decode(payload)
        except ProtocolError as exc:
            return self._error(exc.request_id, exc.code, exc.message), False
        except Exception as exc:  # a bug must not take the run down with it
            log.exception("internal error")
            return self._error(None, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False
        self._op = messages.op_of(request)
        return self.handlers.handle(request, identity, time.monotonic())

    def _handle_stats(self, identity: bytes, payload: list[bytes]) -> tuple[Reply | None, bool]:
        """A stats request's error at once, or None: its snapshot is built in steps and sent when done."""
        request_id = None
        try:
            request = self._decode(payload)
            request_id = request.id
            self.stats_view.check(request)
            self._builds.append(SnapshotBuild(
                self._snapshot_steps(),
                done=lambda snapshot: send_reply(self.stats, identity, messages.StatsReply(id=request_id,
                                                                                           stats=snapshot)),
                failed=lambda exc: send_reply(self.stats, identity, self._error(
                    request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))))
            return None, False
        except ProtocolError as exc:
            return self._error(exc.request_id if exc.request_id is not None else request_id, exc.code, exc.message), False
        except Exception as exc:  # a bug in the snapshot must not take the run down with it
            log.exception("internal error on the stats socket")
            return self._error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False

    def _error(self, request_id: int | None, code: str, message: str) -> messages.ErrorReply:
        return counted_error(self.core, request_id, code, message)

    def close(self) -> None:
        for build in self._builds:  # a stats request waiting for its snapshot is told, /metrics is not
            build.failed(RuntimeError("the dispatcher is stopping"))
        self._builds = []
        self.polls.close()
        if self.journal.failed is None:
            self.journal.record(DispatcherStopped(done=self.core.done, peak_slots=self.core.pool.peak_in_use,
                                                  slot_bytes=self.slot_bytes))
        self.journal.close()  # its last fsync makes every held commit durable
        self.replies.close()
        self.core.close()
        self.auth.unwatch(self.control, self.stats)
        self.control.close(linger=0)
        self.stats.close(linger=0)
        self.auth.close()
        self._context.term()
        self._release()
