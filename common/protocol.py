"""The wire protocol: every control message of hsdispatch, defined once.

A message is one ZeroMQ frame holding a msgpack map. Requests carry the protocol version ``v``,
an ``op`` name and a request ``id`` chosen by the sender; replies echo ``id`` and carry either
``ok: true`` plus the op's result fields, or ``ok: false`` plus ``error: {code, message}``.
msgpack only: no pickle anywhere, so a peer can never make another execute code.

Tensor bytes never travel here: jobs name a slot and its generation, and the bytes move through
the hidden-state transport (shared memory or CUDA IPC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_VERSION = 1

# op -> required request fields (beyond v/op/id). Optional fields are documented at each op.
REQUESTS: dict[str, tuple[str, ...]] = {
    # {role: target|drafter, name, pid, host, gpu?, layout?} -> {worker_id, run_id, transport, ...}
    "register": ("role", "name", "pid", "host"),
    # {worker_id, ipc_block, num_slots} -> {}; a cuda_ipc target offers the slots it allocated on its GPU
    "register_slots": ("worker_id", "ipc_block", "num_slots"),
    # {worker_id} -> {done}; keeps the worker alive (a silent one is declared dead, its jobs given back)
    "heartbeat": ("worker_id",),
    # {worker_id, wait_ms} -> {job: {...} | None, done: bool}; long-poll until a job and a slot are free
    "get_job": ("worker_id", "wait_ms"),
    # {worker_id, job_id, generation, busy_s} -> {}; the slot now holds the job's hidden states
    "job_ready": ("worker_id", "job_id", "generation", "busy_s"),
    # {worker_id, job_id, reason} -> {}; the target could not extract the job: it goes back to pending
    "job_failed": ("worker_id", "job_id", "reason"),
    # {worker_id, wait_ms} -> {job: {...} | None, done: bool}; long-poll for a ready slot
    "get_hs": ("worker_id", "wait_ms"),
    # {worker_id, job_id} -> {}; the drafter copied the slot out: the slot is free again
    "consumed": ("worker_id", "job_id"),
    # {worker_id, job_ids, busy_s, checkpointed, verified?} -> {step}; journaled and fsynced before the reply
    # (verified: how many of the step's slots a sim drafter checked byte for byte)
    "commit_step": ("worker_id", "job_ids", "busy_s", "checkpointed"),
    # {worker_id, step} -> {}; model state up to this global step is durable
    "checkpoint": ("worker_id", "step"),
    # {worker_id} -> {}; leaving cleanly: leased jobs go back at once
    "deregister": ("worker_id",),
    # {} -> {stats snapshot}; served on the read-only stats socket only
    "stats": (),
}

ROLES = ("target", "drafter")


class ErrorCode:
    MALFORMED = "malformed"            # not a msgpack map, missing or ill-typed fields
    BAD_VERSION = "bad_version"        # protocol version differs
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"            # message over dispatcher.max_message_bytes
    UNAUTHORIZED = "unauthorized"      # missing or wrong shared secret
    UNKNOWN_WORKER = "unknown_worker"  # not registered, or declared dead: register again
    BAD_STATE = "bad_state"            # the job is not in the state the op expects (stale lease)
    INCOMPATIBLE = "incompatible"      # the worker cannot serve this run (transport, capture contract)
    READ_ONLY = "read_only"            # a control op sent to the stats socket
    INTERNAL = "internal"


class ProtocolError(Exception):
    """An error reply from the peer, or a message that breaks the protocol."""

    def __init__(self, code: str, message: str, request_id: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id  # of the offending request, when it could be read


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


@dataclass(frozen=True)
class Request:
    op: str
    id: int
    fields: dict[str, Any]


def parse_request(message: dict[str, Any]) -> Request:
    """Check version, op and required fields of a decoded request."""
    request_id = message.get("id", 0)
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError(ErrorCode.MALFORMED, "request id must be an integer")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"protocol version {version!r}, this dispatcher speaks {PROTOCOL_VERSION}", request_id)
    op = message.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}", request_id)
    missing = [name for name in REQUESTS[op] if name not in message]
    if missing:
        raise ProtocolError(ErrorCode.MALFORMED, f"{op}: missing field(s) {', '.join(missing)}", request_id)
    fields = {k: v for k, v in message.items() if k not in ("v", "op", "id")}
    return Request(op=op, id=request_id, fields=fields)


def request(op: str, request_id: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields}


def ok_reply(request_id: int, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields}


def error_reply(request_id: int | None, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": {"code": code, "message": message}}


def field_of(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A request field of the expected type, or a MALFORMED error naming it."""
    value = fields.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} has the wrong type ({type(value).__name__})")
    return value
