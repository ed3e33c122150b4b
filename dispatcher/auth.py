"""CURVE on the dispatcher's two sockets: who may connect, and what was refused.

With ``curve.*`` set the sockets encrypt, a ZAP authorizer (on a thread) accepts only the listed
client keys, and a monitor of each socket counts the handshakes that failed; without it nothing
here does anything. The shared secret (``dispatcher.secret``) is checked as each request is decoded
(:mod:`dispatcher.server`); :meth:`CurveAuth.stats` reports both in the stats snapshot's ``auth``.
"""

from __future__ import annotations

from typing import Any

import zmq

from common.wire.curve import CurveServer, HandshakeMonitor, ZapAuthorizer, auth_stats


class CurveAuth:
    def __init__(self, context: zmq.Context, curve: CurveServer | None):
        self.curve = curve
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

    def stats(self, *, secret: bool) -> dict[str, Any]:
        """The stats snapshot's ``auth`` (``secret``: whether the run sets ``dispatcher.secret``)."""
        return auth_stats(self.authorizer, self.handshakes, secret=secret)

    def unwatch(self, *socks: zmq.Socket) -> None:
        """Stop the monitors, before their sockets close (``socks`` in :meth:`watch`'s order)."""
        for monitor, sock in zip(self.handshakes, socks):
            monitor.close(sock)

    def close(self) -> None:
        if self.authorizer is not None:
            self.authorizer.close()
