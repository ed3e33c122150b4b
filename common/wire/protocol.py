"""The wire protocol's plain-map codec, for the clients that still build their requests as maps.

A message is one ZeroMQ frame holding a msgpack map. Requests carry the protocol version ``v``,
an ``op`` name and a request ``id`` chosen by the sender; replies echo ``id`` and carry either
``ok: true`` plus the op's result fields, or ``ok: false`` plus ``error: {code, message}``.
msgpack only: no pickle anywhere, so a peer can never make another execute code.

Every request and reply, with its fields, is defined once, as a typed struct, in
:mod:`common.wire.messages`; the dispatcher decodes and answers with those.
"""

from __future__ import annotations

from typing import Any

import msgpack

from common.wire.messages import (PROTOCOL_VERSION, ROLES, STORE_SCHEME, ErrorCode, ProtocolError,
                                   parse_store_address, parse_tcp_store, store_address, tcp_store_name)

__all__ = ["PROTOCOL_VERSION", "ROLES", "STORE_SCHEME", "ErrorCode", "ProtocolError", "parse_store_address",
           "parse_tcp_store", "store_address", "tcp_store_name", "pack", "unpack", "request", "error_reply"]


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes, max_bytes: int | None = None) -> dict[str, Any]:
    """Decode one frame into a message map, raising ProtocolError for anything malformed."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "a message must be a msgpack map")
    return message


def request(op: str, request_id: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields}


def error_reply(request_id: int | None, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": {"code": code, "message": message}}
