"""The names of a data-parallel group's rendezvous stores, as register requests and join_group
replies carry them: a rank's TCPStore address (``HOST:PORT``, an IPv6 host in brackets) and a
membership version's store (``tcp://HOST:PORT/PREFIX``, or a FileStore path in the run directory)."""

from __future__ import annotations

from typing import Any

from common.wire.errors import ErrorCode, ProtocolError

STORE_SCHEME = "tcp://"  # a version's store on rank 0's TCPStore (drafter.rendezvous=tcp), not a FileStore path


def parse_store_address(value: Any) -> tuple[str, int]:
    """``(host, port)`` of a rank's rendezvous store (``model.group.store``: ``HOST:PORT``, an IPv6
    host in brackets), or a MALFORMED error naming the field."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() or c in "/[]" for c in host):
        raise ProtocolError(ErrorCode.MALFORMED, f"model.group.store: expected HOST:PORT of the rank's rendezvous "
                                                 f"store, got {value!r}")
    return host, int(port)


def store_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tcp_store_name(address: str, prefix: str) -> str:
    """The store of one membership version: the TCPStore at ``address`` under the key ``prefix``."""
    return f"{STORE_SCHEME}{address}/{prefix}"


def parse_tcp_store(name: str) -> tuple[str, int, str] | None:
    """``(host, port, prefix)`` of a version's TCP store name (None: a FileStore path)."""
    if not name.startswith(STORE_SCHEME):
        return None
    address, _, prefix = name[len(STORE_SCHEME):].partition("/")
    host, port = parse_store_address(address)
    return host, port, prefix
