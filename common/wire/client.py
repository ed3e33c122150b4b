"""A request/reply client for the dispatcher's control and stats sockets (DEALER side).

One client per thread: ZeroMQ sockets are not thread-safe, so a worker's heartbeat thread owns a
client of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from pathlib import Path
from typing import Any

import zmq

from common.wire import messages
from common.wire.curve import CurveClient


# How long a worker keeps trying to reach a dispatcher that went away (the default of
# dispatcher.reconnect_s); the dispatcher counts on a worker of a run it restarted registering again
# within it, or having given up.
RECONNECT_S = 60.0


class DispatcherUnavailable(TimeoutError):
    """No reply within the timeout: the dispatcher is down, restarting or unreachable."""


def run_id_for(run_dir: str | os.PathLike) -> str:
    """Short stable id of a run directory; names the run's shared-memory segments."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


class DispatcherClient:
    def __init__(self, endpoint: str, *, secret: str = "", timeout_s: float = 10.0,
                 context: zmq.Context | None = None, curve: CurveClient | None = None):
        self.endpoint = endpoint
        self.secret = secret
        self.curve = curve
        self.timeout_s = timeout_s
        self._context = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outstanding: dict[int, str] = {}  # request id -> its op, until its reply is taken
        self._early: dict[int, bytes] = {}
        self._socket: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(self._socket)
        self._socket.connect(self.endpoint)

    def reset(self) -> None:
        """Drop queued requests and stale replies (after a timeout) with a fresh socket."""
        self.close()
        self._connect()
        self._outstanding.clear()
        self._early.clear()

    def submit(self, request: messages.Request) -> int:
        """Send a request without waiting (its ``id`` and ``secret`` are set here); collect its
        reply with :meth:`result`.

        Several requests may be in flight (a worker prefetches its next job while it moves the
        bytes of the current one); replies are matched by id, whatever order they come in.
        """
        assert self._socket is not None
        request.id = next(self._ids)
        if self.secret:
            request.secret = self.secret
        self._socket.send(messages.encode(request))
        self._outstanding[request.id] = messages.op_of(request)
        return request.id

    def result(self, request_id: int, *, timeout_s: float | None = None) -> messages.Reply:
        """The reply to a submitted request, as its op's reply struct; raises ProtocolError for an
        error reply, DispatcherUnavailable for a request given up (by a reset) or never sent."""
        op = self._outstanding.get(request_id)
        if op is None:
            raise DispatcherUnavailable(f"request {request_id} is not in flight (the connection was reset)")
        frame = self._wait_for(request_id, timeout_s)
        self._outstanding.pop(request_id, None)
        return messages.decode_reply(frame, op)

    def call(self, request: messages.Request, *, timeout_s: float | None = None) -> messages.Reply:
        """Send one request and wait for its reply; raises ProtocolError for an error reply."""
        return self.result(self.submit(request), timeout_s=timeout_s)

    def call_raw(self, payload: bytes | list[bytes], *, timeout_s: float | None = None) -> Any:
        """Send raw frames and return the next reply, whatever its id, as plain msgpack values
        (tests use it to send garbage)."""
        assert self._socket is not None
        self._socket.send_multipart(payload if isinstance(payload, list) else [payload])
        return messages.decode_any(self._wait_for(None, timeout_s))

    def _wait_for(self, request_id: int | None, timeout_s: float | None) -> bytes:
        if request_id in self._early:
            return self._early.pop(request_id)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining_ms = int(1000 * (deadline - time.monotonic()))
            if remaining_ms <= 0 or not self._socket.poll(remaining_ms):
                self.reset()
                raise DispatcherUnavailable(f"no reply from {self.endpoint} within {timeout:.1f}s")
            frame = self._socket.recv()
            reply_id = messages.reply_id(frame)
            if request_id is None or reply_id == request_id or reply_id is None:
                if reply_id is not None and reply_id != request_id:
                    self._outstanding.pop(reply_id, None)  # call_raw took it
                return frame
            if reply_id in self._outstanding:  # another request in flight: keep it for its caller
                self._early[reply_id] = frame
            # else a late reply to a request given up on (after a reset): dropped

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
