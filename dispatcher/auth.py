"""How the dispatcher's two sockets tell a peer allowed from one that is not.

Two mechanisms, either or both: CURVE (``curve.*``: the sockets encrypt and a ZAP authorizer
accepts only the listed client keys; handshake monitors count what it refused) and the shared
secret (``dispatcher.secret``: every request carries it, compared in constant time). Nothing here
decides anything about jobs; the socket loop asks :meth:`ControlAuth.check_secret` of every request.
"""

from __future__ import annotations

import hmac
from typing import Any

import zmq

from common.wire import messages
from common.wire.curve import CurveServer, HandshakeMonitor, ZapAuthorizer, auth_stats
from common.wire.messages import ErrorCode, ProtocolError


class ControlAuth:
    def __init__(self, context: zmq.Context, curve: CurveServer | None, secret: str):
        self.curve = curve
        self.secret = secret
        # The authorizer must listen before the first handshake: libzmq drops a CURVE connection
        # whose authentication request finds no handler.
        self.authorizer = ZapAuthorizer(context, curve.allowed) if curve is not None else None
        self.handshakes: list[HandshakeMonitor] = []

    def secure(self, sock: zmq.Socket) -> None:
        """Make a socket about to bind a CURVE server (nothing without CURVE)."""
        if self.curve is not None:
            self.curve.apply(sock)

    def watch(self, *socks: zmq.Socket) -> None:
        """Count the failed handshakes of the bound sockets (CURVE only)."""
        if self.curve is not None:
            self.handshakes = [HandshakeMonitor(sock) for sock in socks]

    def check_secret(self, request: messages.Request) -> None:
        secret, given = self.secret, request.secret
        if secret and (given is None or not hmac.compare_digest(given.encode(), secret.encode())):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong shared secret", request.id)

    def stats(self) -> dict[str, Any]:
        """The stats snapshot's ``auth``."""
        return auth_stats(self.authorizer, self.handshakes, secret=bool(self.secret))

    def unwatch(self, *socks: zmq.Socket) -> None:
        """Stop the monitors, before their sockets close (``socks`` in :meth:`watch`'s order)."""
        for monitor, sock in zip(self.handshakes, socks):
            monitor.close(sock)

    def close(self) -> None:
        if self.authorizer is not None:
            self.authorizer.close()
