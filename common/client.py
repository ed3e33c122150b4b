"""A request/reply client for the dispatcher's control and stats sockets (DEALER side).

One client per thread: ZeroMQ sockets are not thread-safe, so a worker's heartbeat thread owns a
client of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path
from typing import Any

import zmq

from common import protocol
from common.protocol import ErrorCode, ProtocolError


class DispatcherUnavailable(TimeoutError):
    """No reply within the timeout: the dispatcher is down, restarting or unreachable."""


def run_id_for(run_dir: str | os.PathLike) -> str:
    """Short stable id of a run directory; names the run's shared-memory segments."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


class DispatcherClient:
    def __init__(self, endpoint: str, *, secret: str = "", timeout_s: float = 10.0,
                 context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.secret = secret
        self.timeout_s = timeout_s
        self._context = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._socket: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)

    def reset(self) -> None:
        """Drop queued requests and stale replies (after a timeout) with a fresh socket."""
        self.close()
        self._connect()

    def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises ProtocolError for an error reply."""
        request_id = next(self._ids)
        message = protocol.request(op, request_id, **fields)
        if self.secret:
            message["secret"] = self.secret
        reply = self.call_raw(protocol.pack(message), request_id, timeout_s=timeout_s)
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise ProtocolError(error.get("code", ErrorCode.INTERNAL), error.get("message", "error reply"))
        return reply

    def call_raw(self, payload: bytes | list[bytes], request_id: int | None = None, *,
                 timeout_s: float | None = None) -> dict[str, Any]:
        """Send raw frames and return the decoded reply (tests use it to send garbage)."""
        assert self._socket is not None
        frames = payload if isinstance(payload, list) else [payload]
        self._socket.send_multipart(frames)
        deadline_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        while True:
            if not self._socket.poll(deadline_ms):
                self.reset()
                raise DispatcherUnavailable(f"no reply from {self.endpoint} within {deadline_ms / 1000:.1f}s")
            reply = protocol.unpack(self._socket.recv())
            if request_id is None or reply.get("id") in (request_id, None):
                return reply
            # A late reply to an earlier, timed-out request: drop it.

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
