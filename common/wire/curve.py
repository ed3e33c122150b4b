"""ZeroMQ CURVE for the control and stats sockets between nodes: key pairs, socket options, and the
dispatcher's authorizer.

On one node the sockets are ``ipc://`` files in the run directory, which the file system guards.
Between nodes they run over TCP, and there a shared string compared per message is no protection:
anyone on the network can read it off the wire. CURVE encrypts every connection and authenticates
both ends at the handshake, before a single message is read:

- the dispatcher holds a secret key; every worker (and ``hsd stats``) knows the dispatcher's public
  key and holds a key pair of its own;
- the dispatcher accepts a connection only from a public key in ``curve.allowed_client_keys``. The
  check runs in a ZAP handler (ZeroMQ's authentication protocol, RFC 27) on a thread of the
  dispatcher: a refused key never reaches the socket loop, and is counted;
- a worker that connects without CURVE, or with the wrong dispatcher key, fails the handshake; the
  dispatcher's socket monitor counts those too.

Keys are ZeroMQ's certificate files (``hsd keys --out DIR`` writes them): ``NAME.key`` holds the
public key, ``NAME.key_secret`` the pair. Config values that name a key take either the 40-character
Z85 text of a public key or the path of such a file.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from common.run.config import ConfigError
from common.wire.stats_snapshot import AuthView

log = logging.getLogger("hsd.curve")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends a CURVE server's authentication requests
ZAP_DOMAIN = b"hsd"
_Z85_KEY_LENGTH = 40


class CurveKeyError(ConfigError):
    """A key file or key text that cannot be used (missing, unreadable, not a CURVE key)."""


def generate_keys(out_dir: str | os.PathLike, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """Write a key pair per name into ``out_dir``: ``{name: (public file, secret file)}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise CurveKeyError(f"key name {name!r}: use a plain file name")
        if (out / f"{name}.key").exists() or (out / f"{name}.key_secret").exists():
            raise CurveKeyError(f"{out / name}.key already exists; remove it or choose another --out")
        public, secret = zmq.auth.create_certificates(str(out), name)
        os.chmod(secret, 0o600)
        written[name] = (Path(public), Path(secret))
    return written


def public_key(value: str, *, what: str) -> bytes:
    """A public key from its Z85 text or from a certificate file (``NAME.key`` or ``NAME.key_secret``)."""
    value = value.strip()
    if len(value) == _Z85_KEY_LENGTH and not os.path.exists(value):
        return value.encode()
    public, _ = _read_certificate(value, what=what)
    return public


def key_pair(path: str, *, what: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``NAME.key_secret`` file."""
    public, secret = _read_certificate(path, what=what)
    if secret is None:
        raise CurveKeyError(f"{what}: {path} holds only a public key; name the .key_secret file")
    return public, secret


def _read_certificate(path: str, *, what: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise CurveKeyError(f"{what}: no key file {path!r} (hsd keys --out DIR makes key pairs)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise CurveKeyError(f"{what}: {path} is not a CURVE key file: {exc}") from None
    return public, secret


@dataclass(frozen=True)
class CurveClient:
    """What a connecting socket needs: the dispatcher's public key and its own pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@dataclass(frozen=True)
class CurveServer:
    """What the dispatcher's sockets need: its own pair and the public keys it accepts."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.zap_domain = ZAP_DOMAIN


class ZapAuthorizer:
    """Answers libzmq's authentication requests for the dispatcher's CURVE sockets, on a thread.

    It accepts a client whose public key is allowed and refuses any other; ``counts`` holds
    ``accepted`` and ``refused``. Only CURVE requests of our domain are answered yes: a socket of
    the same context that asks with another mechanism is refused too.
    """

    def __init__(self, context: zmq.Context, allowed: frozenset[bytes]):
        self.allowed = {zmq.utils.z85.decode(key) for key in allowed}
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._socket = context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind(ZAP_ENDPOINT)
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._stop_r in events:
                return
            frames = self._socket.recv_multipart()
            version, request_id, domain, address = frames[:4]
            mechanism, credentials = frames[5], frames[6:]
            ok = (version == b"1.0" and domain == ZAP_DOMAIN and mechanism == b"CURVE"
                  and bool(credentials) and credentials[0] in self.allowed)
            with self._lock:
                self.counts["accepted" if ok else "refused"] += 1
            if not ok:
                key = zmq.utils.z85.encode(credentials[0]).decode() if mechanism == b"CURVE" and credentials else "none"
                log.warning("refused a %s connection from %s: client key %s is not in curve.allowed_client_keys",
                            mechanism.decode(errors="replace"), address.decode(errors="replace"), key)
            self._socket.send_multipart([version, request_id, b"200" if ok else b"400",
                                         b"OK" if ok else b"client key not allowed", b"", b""])

    def close(self) -> None:
        os.write(self._stop_w, b"\0")
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        os.close(self._stop_r)
        os.close(self._stop_w)


class HandshakeMonitor:
    """Counts the failed handshakes of one socket (a client without CURVE, a wrong dispatcher key,
    a refused client key) from its monitor events; :meth:`drain` is called from the socket loop."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

    def __init__(self, sock: zmq.Socket):
        self.socket = sock.get_monitor_socket(self.EVENTS)
        self.failed = 0

    def drain(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while self.socket.poll(0):
            event = recv_monitor_message(self.socket)
            if event["event"] & self.EVENTS:
                self.failed += 1

    def close(self, sock: zmq.Socket) -> None:
        sock.disable_monitor()
        self.socket.close(linger=0)


def auth_stats(authorizer: ZapAuthorizer | None, handshakes: list[HandshakeMonitor], *,
               secret: bool) -> AuthView:
    """How a control plane authenticates, and the handshakes it refused (CURVE only): ``hsd stats``'s ``auth``."""
    if authorizer is None:
        return AuthView(mechanism="secret" if secret else "none")
    for monitor in handshakes:
        monitor.drain()
    counts = authorizer.snapshot()
    return AuthView(mechanism="curve", accepted=counts.get("accepted", 0), refused=counts.get("refused", 0),
                    handshakes_failed=sum(m.failed for m in handshakes))


def _allowed_keys(entries: list[str]) -> frozenset[bytes]:
    keys = set()
    for entry in entries:
        if os.path.isdir(entry):
            files = sorted(Path(entry).glob("*.key"))
            if not files:
                raise CurveKeyError(f"curve.allowed_client_keys: directory {entry} holds no .key file")
            keys.update(public_key(str(f), what="curve.allowed_client_keys") for f in files)
        else:
            keys.add(public_key(entry, what="curve.allowed_client_keys"))
    return frozenset(keys)


def client_from_config(curve) -> CurveClient | None:
    """The connecting side's keys from a config's ``curve`` section; None when CURVE is off."""
    if not curve.enabled:
        return None
    if not curve.client_secret_key:
        raise CurveKeyError("curve.client_secret_key: with curve.server_public_key set, every worker needs a key "
                            "pair of its own (hsd keys --out DIR --name NAME)")
    public, secret = key_pair(curve.client_secret_key, what="curve.client_secret_key")
    return CurveClient(server_public=public_key(curve.server_public_key, what="curve.server_public_key"),
                       public=public, secret=secret)


def server_from_config(curve) -> CurveServer | None:
    """The dispatcher's keys from a config's ``curve`` section; None when CURVE is off."""
    if not curve.enabled:
        return None
    if not curve.server_secret_key:
        raise CurveKeyError("curve.server_secret_key: the dispatcher needs its .key_secret file to serve CURVE")
    public, secret = key_pair(curve.server_secret_key, what="curve.server_secret_key")
    if public != public_key(curve.server_public_key, what="curve.server_public_key"):
        raise CurveKeyError("curve.server_public_key is not the public half of curve.server_secret_key")
    if not curve.allowed_client_keys:
        raise CurveKeyError("curve.allowed_client_keys: list the workers' public keys (or a directory of .key "
                            "files); with none, no worker could connect")
    return CurveServer(public=public, secret=secret, allowed=_allowed_keys(curve.allowed_client_keys))


def handshake_refused(endpoint: str, curve: CurveClient | None, *, timeout_s: float = 5.0) -> bool:
    """Whether a connection to ``endpoint`` with ``curve`` (None: without CURVE) fails its handshake
    (a CURVE dispatcher meeting a plain client, or refusing its key) rather than succeeding or finding
    no listener: a dispatcher that never answers is then told apart from one that will not talk to
    this client. It returns at the handshake's outcome (``timeout_s``: with no listener)."""
    from zmq.utils.monitor import recv_monitor_message
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    monitor = sock.get_monitor_socket(HandshakeMonitor.EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        if not monitor.poll(int(timeout_s * 1000)):
            return False
        return bool(recv_monitor_message(monitor)["event"] & HandshakeMonitor.EVENTS)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def client_from_keys(keys_dir: str | os.PathLike, client: str | None = None) -> CurveClient:
    """The keys ``hsd keys --out DIR`` made: the dispatcher's public key and the pair named ``client``
    (the directory's only other pair when None)."""
    keys = Path(keys_dir)
    server = keys / "dispatcher.key"
    if not server.is_file():
        raise CurveKeyError(f"--keys {keys}: no dispatcher.key (give the directory hsd keys --out wrote)")
    if client is None:
        pairs = sorted(p.name.removesuffix(".key_secret") for p in keys.glob("*.key_secret")
                       if p.name != "dispatcher.key_secret")
        if len(pairs) != 1:
            raise CurveKeyError(f"--keys {keys}: {len(pairs)} client key pairs ({', '.join(pairs) or 'none'}): "
                                f"name this node's with --client NAME")
        client = pairs[0]
    public, secret = key_pair(str(keys / f"{client}.key_secret"), what=f"--client {client}")
    return CurveClient(server_public=public_key(str(server), what="--keys dispatcher.key"), public=public,
                       secret=secret)
