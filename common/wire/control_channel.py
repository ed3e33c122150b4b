"""A worker's control connection: one DEALER socket, its replies and heartbeats handled by an I/O thread.

The worker's main thread computes for seconds at a time while requests it sent ahead (a prefetched
``get_job``/``get_hs``) are answered. Replies must be seen when they arrive, not when the main
thread next looks: a grant the worker has not read yet is already a job it holds, and the heartbeat
has to say so. So an I/O thread receives every reply, runs ``on_reply`` on it at once (the
held-jobs bookkeeping) and sends the heartbeats itself: only those due when the worker sent no
request within the interval, the dispatcher counting any request as a sign of life
(:mod:`common.wire.heartbeats`).

The socket is used by one thread at a time, whichever holds its lock (ZeroMQ allows a socket to move
between threads across a full memory barrier). A request goes out from ``submit`` on the caller's
thread, in order (a heartbeat never overtakes a report sent before it): handing every request to
the I/O thread through a pipe cost a thread wake-up per request, a third of a round trip. The I/O
thread sleeps on the socket's ZMQ_FD, not on the socket, so it holds nothing while it waits. That
descriptor only says "look at ZMQ_EVENTS", and any operation on the socket can consume its signal:
whoever used the socket last looks at ZMQ_EVENTS before anyone sleeps, and a sender that finds a
reply waiting wakes the I/O thread through its pipe. Anything that cannot go at once (the socket's
queue is full, or commands are queued before it) waits in an outbox the I/O thread sends in order.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable

import zmq

from common.wire import messages
from common.wire.client import DispatcherUnavailable
from common.wire.curve import CurveClient
from common.wire.heartbeats import BeatSchedule
from common.wire.messages import ErrorCode, ProtocolError

log = logging.getLogger("hsd.worker")

_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's flag enums cost a Python call per operator
_POLLIN = int(zmq.POLLIN)

# (the request, its reply: the op's reply struct, or an ErrorReply for a refusal or a reply that broke the protocol)
ReplyHook = Callable[[messages.Request, messages.Reply], None]
HeartbeatFields = Callable[[], "messages.Heartbeat | None"]


class ControlChannel:
    def __init__(self, endpoint: str, *, secret: str = "", curve: CurveClient | None = None,
                 on_reply: ReplyHook | None = None, name: str = "worker"):
        self.endpoint = endpoint
        self.secret = secret
        self.curve = curve
        self._on_reply = on_reply
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._outbox: deque[tuple[str, Any]] = deque()  # (command, argument) for the I/O thread
        self._pending: dict[int, messages.Request] = {}  # request id -> the request, until answered
        self._replies: dict[int, messages.Reply] = {}
        self._dropped: set[int] = set()  # ids given up by reset(): their waiters get no reply
        self._heartbeat: tuple[float, HeartbeatFields] | None = None
        # When submit() last sent a request: a beat due within an interval of it is skipped (common.wire.heartbeats).
        self._last_request_at = float("-inf")
        self.heartbeat_refused = threading.Event()  # the dispatcher no longer knows the heartbeat's worker
        # The latest answered beat of the current setting: (its number, the reply's membership). A rank
        # in a collective compares beats answered since the collective began with its version.
        self._beat_answer: tuple[int, int | None] = (0, None)
        self._waits_end_by: float | None = None  # limit_waits(): no wait for a reply lasts past this
        self._wait_limit_s = 0.0
        # Bumped by every set_heartbeat(): a refusal counts only for the beats of the current setting,
        # so a late refusal of the previous session's beat cannot fail the next registration.
        self._beat_generation = 0
        # When the dispatcher last answered (anything but a refusal), and the longest it was silent
        # since forget_silence(): a worker paused or cut off past a bound may have been given up on.
        self._answered_at = time.monotonic()
        self._longest_silence_s = 0.0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        # The socket and the outbox's order: whoever holds this lock may use the socket (None once closed).
        # Lock order: this one, then _cond.
        self._sock_lock = threading.Lock()
        self._sock: zmq.Socket | None = self._connect(zmq.Context.instance())
        self._thread = threading.Thread(target=self._serve, name=f"{name}-control", daemon=True)
        self._thread.start()

    # -- the main thread's side ---------------------------------------------------------------
    def submit(self, request: messages.Request) -> int:
        """Queue a request without waiting (its ``id`` and ``secret`` are set here); its reply is kept
        for :meth:`result` (matched by id)."""
        request_id = request.id = next(self._ids)
        if self.secret:
            request.secret = self.secret
        frame = messages.encode(request)
        with self._sock_lock:
            self._last_request_at = time.monotonic()
            with self._cond:
                if self._closed or self._sock is None:
                    raise RuntimeError("the control channel is closed")
                self._pending[request_id] = request
                queued = bool(self._outbox)  # behind what waits there, in order
                if queued:
                    self._outbox.append(("send", frame))
            if not queued:
                queued = not self._send_now(frame)
                if queued:
                    with self._cond:
                        self._outbox.append(("send", frame))
            wake = queued or self._reply_waiting()
        if wake:
            self._wake()
        return request_id

    def _send_now(self, frame: bytes) -> bool:
        """Send without blocking (the caller holds the socket); False: the socket's queue is full."""
        try:
            self._sock.send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _reply_waiting(self) -> bool:
        """Whether a message waits on the socket (the caller holds it): the operation just made may
        have taken the ZMQ_FD signal the I/O thread sleeps on."""
        return bool(self._sock.getsockopt(zmq.EVENTS) & _POLLIN)

    def result(self, request_id: int, *, timeout_s: float) -> messages.Reply:
        """The reply to a submitted request, as its op's reply struct: ProtocolError for an error reply
        (or one that breaks the protocol); DispatcherUnavailable when none came within ``timeout_s``
        (the socket is then reset: late replies are dropped)."""
        started = time.monotonic()
        timed_out = False
        with self._cond:
            while request_id not in self._replies:
                if request_id in self._dropped or request_id not in self._pending:
                    break
                if self.heartbeat_refused.is_set():
                    self._pending.pop(request_id, None)
                    raise ProtocolError(ErrorCode.UNKNOWN_WORKER, "the dispatcher refused our heartbeat")
                deadline = started + timeout_s
                if self._waits_end_by is not None:
                    deadline = min(deadline, max(self._waits_end_by, started + self._wait_limit_s))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                self._cond.wait(remaining)
            reply = self._replies.pop(request_id, None)
            self._dropped.discard(request_id)
        if reply is None:
            if timed_out:
                self.reset()
                raise DispatcherUnavailable(f"no reply from {self.endpoint} within {timeout_s:.1f}s")
            raise DispatcherUnavailable(f"request {request_id} was given up (the connection was reset)")
        if isinstance(reply, messages.ErrorReply):
            raise ProtocolError(reply.error.code, reply.error.message, request_id)
        return reply

    def limit_waits(self, seconds: float) -> None:
        """From now on no wait for a reply lasts more than ``seconds``, and the waits under way end
        ``seconds`` from now at the latest (a worker asked to stop: a dispatcher that answers still
        does so in time, and one that does not keeps the worker no longer than that). Safe to call
        from a signal handler: the condition's lock is reentrant."""
        with self._cond:
            self._waits_end_by = time.monotonic() + seconds
            self._wait_limit_s = seconds
            self._cond.notify_all()

    def done(self, request_id: int) -> bool:
        """Whether the reply to ``request_id`` is in (or will never come), without waiting."""
        with self._cond:
            return request_id in self._replies or request_id in self._dropped or request_id not in self._pending

    def call(self, request: messages.Request, *, timeout_s: float) -> messages.Reply:
        return self.result(self.submit(request), timeout_s=timeout_s)

    def reset(self) -> None:
        """A fresh socket: requests still queued or unanswered are given up (their waiters fail at once),
        so a dispatcher that comes back does not receive a burst of stale requests."""
        with self._sock_lock, self._cond:
            self._dropped.update(self._pending)
            self._pending.clear()
            self._outbox.append(("reset", None))
            self._cond.notify_all()
        self._wake()

    def set_heartbeat(self, interval_s: float | None, fields: HeartbeatFields | None = None) -> None:
        """Send ``fields()`` (a Heartbeat; None skips a beat) every ``interval_s`` unless a request went
        out within the interval (:class:`~common.wire.heartbeats.BeatSchedule`); None stops."""
        with self._sock_lock, self._cond:
            self._beat_generation += 1
            self.heartbeat_refused.clear()
            self._outbox.append(("heartbeat", (self._beat_generation,
                                               None if interval_s is None else (interval_s, fields))))
        self._wake()

    def forgotten(self) -> None:
        """A reply said the dispatcher does not know this worker: beats stop, and every wait learns it
        at once, as from a refused beat (a reply still pending, a collective's watch), until the
        worker registers again (its next ``set_heartbeat`` clears it)."""
        self.set_heartbeat(None)
        with self._cond:
            self.heartbeat_refused.set()
            self._cond.notify_all()

    def beat_answer(self) -> tuple[int, int | None]:
        """(how many beats of the current heartbeat setting were answered, the membership the latest
        answer named: the version naming this worker then, 0 for none)."""
        with self._cond:
            return self._beat_answer

    def close(self) -> None:
        with self._sock_lock, self._cond:
            if self._closed:
                return
            self._closed = True
            self._outbox.append(("stop", None))
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already: the thread will look
            pass

    # -- the I/O thread -----------------------------------------------------------------------
    def _connect(self, context: zmq.Context) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.endpoint)
        return sock

    def _serve(self) -> None:
        context = zmq.Context.instance()
        heartbeat_ids: set[int] = set()
        beat_generation = 0  # the set_heartbeat() the beats in flight were sent under
        next_beat = float("inf")
        beats: BeatSchedule | None = None
        look = True  # the socket may hold what its ZMQ_FD no longer signals: look before sleeping
        poller = zmq.Poller()
        with self._sock_lock:
            signal_fd = self._sock.getsockopt(zmq.FD)
        poller.register(signal_fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                if look:
                    timeout_ms = 0
                elif next_beat == float("inf"):
                    timeout_ms = None
                else:
                    timeout_ms = max(0, int(1000 * (next_beat - time.monotonic())))
                events = dict(poller.poll(timeout_ms))
                look = False
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                frames: list[bytes] = []
                with self._sock_lock:
                    sock = self._sock
                    while True:  # the outbox, in order; a frame that cannot go yet stays first
                        with self._cond:
                            if not self._outbox:
                                break
                            command, argument = self._outbox[0]
                            if command == "send" and not self._send_now(argument):
                                look = True  # try again shortly
                                break
                            self._outbox.popleft()
                        if command == "reset":
                            poller.unregister(signal_fd)
                            sock.close(linger=0)
                            sock = self._sock = self._connect(context)
                            signal_fd = sock.getsockopt(zmq.FD)
                            poller.register(signal_fd, zmq.POLLIN)
                            heartbeat_ids.clear()
                        elif command == "heartbeat":
                            heartbeat_ids.clear()  # replies to a previous registration's beats mean nothing now
                            beat_generation, self._heartbeat = argument
                            next_beat = float("inf") if self._heartbeat is None else time.monotonic() + self._heartbeat[0]
                            beats = None if self._heartbeat is None else BeatSchedule(self._heartbeat[0])
                        elif command == "stop":
                            return
                    while sock.getsockopt(zmq.EVENTS) & _POLLIN:
                        frames.append(sock.recv(_NOBLOCK))
                for frame in frames:
                    self._receive(frame, heartbeat_ids, beat_generation)
                if self._heartbeat is None:
                    next_beat = float("inf")
                elif (now := time.monotonic()) >= next_beat:
                    interval_s, fields = self._heartbeat
                    next_beat = now + interval_s
                    goes_out = beats is None or beats.goes_out(now, self._last_request_at)  # else it was busy
                    beat = fields() if fields is not None and goes_out else None
                    if beat is not None:
                        beat.id = next(self._ids)
                        heartbeat_ids.add(beat.id)
                        if self.secret:
                            beat.secret = self.secret
                        frame = messages.encode(beat)
                        with self._sock_lock:  # never ahead of a request still queued: that beat is skipped
                            if not self._outbox:
                                self._send_now(frame)
                        look = True
        except Exception:
            log.exception("control channel to %s failed", self.endpoint)
        finally:
            with self._sock_lock:
                if self._sock is not None:
                    self._sock.close(linger=0)
                    self._sock = None
                with self._cond:
                    self._closed = True
                    self._dropped.update(self._pending)
                    self._pending.clear()
                    self._cond.notify_all()

    def silent_for_s(self) -> float:
        """The longest the dispatcher went without answering since :meth:`forget_silence`, now included."""
        with self._cond:
            return max(self._longest_silence_s, time.monotonic() - self._answered_at)

    def forget_silence(self) -> None:
        """The dispatcher took this worker's state as it is (a registration): earlier silences are over."""
        with self._cond:
            self._answered_at, self._longest_silence_s = time.monotonic(), 0.0

    def _answered(self) -> None:
        """A reply that is not a refusal arrived (the caller holds ``_cond``)."""
        now = time.monotonic()
        self._longest_silence_s = max(self._longest_silence_s, now - self._answered_at)
        self._answered_at = now

    def _receive(self, frame: bytes, heartbeat_ids: set[int], beat_generation: int) -> None:
        request_id = messages.reply_id(frame)
        if request_id is None:
            log.warning("dropped a reply from %s that names no request", self.endpoint)
            return
        if request_id in heartbeat_ids:
            heartbeat_ids.discard(request_id)
            try:
                reply = messages.decode_reply(frame, "heartbeat")
                with self._cond:
                    self._answered()
                    if beat_generation == self._beat_generation:
                        self._beat_answer = (self._beat_answer[0] + 1, reply.membership)
            except ProtocolError as exc:
                if exc.code != ErrorCode.UNKNOWN_WORKER:
                    return
                # Beating on would only draw more refusals; a worker waiting on a long-poll learns it
                # now rather than when its poll times out (a restarted dispatcher lost it). A refusal
                # of beats the main thread has already replaced (it is registering again) is ignored.
                with self._cond:
                    if beat_generation == self._beat_generation:
                        self._heartbeat = None
                        self.heartbeat_refused.set()
                        self._cond.notify_all()
            return
        # One critical section from "no longer pending" to "reply kept": a result() that looked in
        # between would find the request neither pending nor answered, take it for given up, and ask
        # again, while the hook had already counted the granted job as held (held for good: every
        # heartbeat lists it, so the dispatcher never gives it back). The hook takes only the held
        # jobs' own lock, which nothing holds while it waits for this one.
        with self._cond:
            request = self._pending.pop(request_id, None)
            if request is None:
                return  # a reply to a request given up on
            try:
                reply = messages.decode_reply(frame, messages.op_of(request))
            except ProtocolError as exc:
                reply = messages.error_reply(request_id, exc.code, exc.message)
            if not (isinstance(reply, messages.ErrorReply) and reply.error.code == ErrorCode.UNKNOWN_WORKER):
                self._answered()
            if self._on_reply is not None:
                try:
                    self._on_reply(request, reply)
                except Exception:
                    log.exception("reply hook failed on %s", messages.op_of(request))
            self._replies[request_id] = reply
            self._cond.notify_all()
