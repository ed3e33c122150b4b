"""The wire protocol: every control message of hsdispatch, defined once.

A message is one ZeroMQ frame holding a msgpack map. Requests carry the protocol version ``v``,
an ``op`` name and a request ``id`` chosen by the sender; replies echo ``id`` and carry either
``ok: true`` plus the op's result fields, or ``ok: false`` plus ``error: {code, message}``.
msgpack only: no pickle anywhere, so a peer can never make another execute code.

Tensor bytes never travel here: jobs name a slot and its generation, and the bytes move through
the hidden-state transport (shared memory or CUDA IPC).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from common.wire.messages import (PROTOCOL_VERSION, ROLES, STORE_SCHEME, ErrorCode, ProtocolError,  # noqa: F401
                                   parse_store_address, parse_tcp_store, store_address, tcp_store_name)

# op -> required request fields (beyond v/op/id). Optional fields are documented at each op.
# Every op after ``register`` carries the ``worker_id`` and the session ``token`` that registration
# returned: a request under a registered id without its token is refused (``unauthorized``).
REQUESTS: dict[str, tuple[str, ...]] = {
    # {role: target|drafter, name, pid, host, node?, gpu?, contract?, model?}
    #   -> {worker_id, token, run_id, transport, heartbeat_s, worker_timeout_s, accum_steps, buckets,
    #       epochs, contract, model_step?, jobs_per_epoch?}
    # jobs_per_epoch (drafter): the jobs of one epoch's schedule (every epoch has as many); a drafter
    #   whose <section>.total_steps is 0 spans its learning-rate schedule over run.epochs of them.
    # node: the node it runs on (default: host); with pool.transport=nixl the reply's transport map
    #   echoes it, a target's slots live on it and drafters are given their own node's slots first.
    # contract: the capture contract the worker produces (target) or expects (drafter); one that
    #   differs from the run's is refused (incompatible), naming both sides.
    # model (drafter): {id, step}: the model it trains and the step of the state it holds now
    #   (0 = fresh). The ledger rolls that model back to exactly that step: its commits after it go
    #   back to pending. The reply's model_step is the step the ledger now holds for the model; a
    #   model *ahead* of the ledger (its last commit never became durable) must reload its latest
    #   checkpoint and register again with that step.
    # model.pending (drafter, optional): {step, job_ids} of the commit it (or its group's rank 0)
    #   sent and got no answer to (its dispatcher died): when the ledger holds exactly that commit the reply says
    #   pending_committed, the drafter applies it and the ledger keeps the step (no rollback).
    # model.checkpoint (drafter, optional, <= step): the step of the newest checkpoint it loaded or
    #   wrote. The dispatcher counts it as durable (journaled) when it is of the ledger's history, so
    #   a checkpoint whose report found no dispatcher still lets the run end.
    # model.group = {size, min_ranks, max_ranks} (data-parallel drafters): drafters of the same model
    #   id are ranks of one elastic group (dispatcher/groups.py). A rank's registration only puts it
    #   in line: it holds no jobs until a version names it (join_group), and its step rolls the
    #   ledger back only when the whole group starts from a checkpoint.
    #   group.store = "HOST:PORT" (drafter.rendezvous=tcp): the TCPStore server the rank hosts; the
    #   versions whose rank 0 it is meet there (see STORE_SCHEME). Every rank of a model has one, or none.
    "register": ("role", "name", "pid", "host"),
    # {wait_ms, after, step, failed?} -> {group: {rank, world_size, membership, store, step, source,
    #   transfer} | None, model_step, membership}; long-poll for the membership version newer than ``after`` that
    #   names this rank (after=0: any). ``step``: the model step the rank holds. ``failed``: a
    #   collective of version ``after`` failed on this rank, which ends that version at once. A rank
    #   at a rendezvous asks with wait_ms=0 between waits, so it learns at once that its version ended
    #   (membership: the version that names the rank now, 0 while it waits for one).
    #   reload (only in a reply without a group): no live rank holds the committed step and the
    #   model's durable checkpoint at step ``reload`` is newer than this rank's state: load the
    #   latest checkpoint and ask again with its step (the group opens from it, not from older state).
    #   transfer: some rank holds another step than the version's; rank ``source`` sends its state
    #   (model, optimizer, scheduler, RNG, witness) to the others over the new group before any step.
    #   store: the version's rendezvous: a FileStore path in the run directory, or
    #   "tcp://HOST:PORT/PREFIX", rank 0's TCPStore under a key prefix of the version's own.
    "join_group": ("worker_id", "token", "wait_ms", "after", "step"),
    # {ipc_block, num_slots} -> {}; a cuda_ipc target offers the slots it allocated on its GPU, a nixl
    # target those in its node's memory (ipc_block: {kind: nixl, node, arena, agent, metadata, base, nbytes})
    "register_slots": ("worker_id", "token", "ipc_block", "num_slots"),
    # {holding: [job_id], seen_grant?} -> {done}; keeps the worker alive (a silent one is declared
    # dead, its jobs given back). ``holding`` lists every job the worker holds (extracting, reading,
    # consumed but not committed); ``seen_grant`` is the ``grant`` number of the latest job it
    # received (every job a get_job/get_hs hands out carries one, counting 1, 2, ... per session).
    # A job the dispatcher thinks it holds, granted no later than seen_grant and not listed, is
    # given back at once (it was dropped, or its reply was lost).
    "heartbeat": ("worker_id", "token", "holding"),
    # {wait_ms} -> {job: {...} | None, done: bool}; long-poll until a job and a slot are free
    "get_job": ("worker_id", "token", "wait_ms"),
    # {job_id, generation, busy_s} -> {}; the slot now holds the job's hidden states
    "job_ready": ("worker_id", "token", "job_id", "generation", "busy_s"),
    # {job_id, reason} -> {}; the target could not extract the job: it goes back to pending
    "job_failed": ("worker_id", "token", "job_id", "reason"),
    # {wait_ms, membership?} -> {job: {...} | None, done: bool, flush: bool, step_full?: int};
    # long-poll for a ready slot (flush: nothing more is coming for now, commit a partial step;
    # step_full: a rank of a drafter.step_balance=cost group holds its share of this model step, it
    # goes to the all-reduce). membership: a group rank's version; a version that ended answers
    # group_changed (so a poll sent before a change is void)
    "get_hs": ("worker_id", "token", "wait_ms"),
    # {job_id} -> {}; the drafter copied the slot out: the slot is free again
    "consumed": ("worker_id", "token", "job_id"),
    # {job_id, reason} -> {}; the drafter could not read the slot (stale generation): the job is
    # extracted again and the drafter carries on
    "read_failed": ("worker_id", "token", "job_id", "reason"),
    # {model, step, job_ids, busy_s, verified?} -> {step, done}; the model took optimizer step
    # ``step`` (its previous step + 1) on exactly these jobs. Journaled and fsynced before the reply.
    # Idempotent: the same (model, step, job_ids) again gets the first answer.
    # (verified: how many of the step's slots a sim drafter checked byte for byte; metrics: a few
    # named floats of the drafter's previous step, loss and the like, and "step", the one they are
    # of: shown by hsd stats, journaled with the commit)
    # A data-parallel group commits once per step (its rank 0, with membership: its version), naming
    # every rank's jobs; any jobs consumed by a current member count. The reply's membership is the
    # group's version after the commit: a newer one means waiting ranks join at this step boundary.
    # (sync_wait_s: rank 0's wait at the gradient all-reduce; rank_jobs, rank_busy_s: how many of
    # job_ids — or of cost_jobs, an earlier step's on a GPU, whose times come late — each rank
    # trained, in rank order, and its busy seconds: what the step-cost model learns from)
    "commit_step": ("worker_id", "token", "model", "step", "job_ids", "busy_s"),
    # {model, step, job_ids, membership} -> {committed, model_step}; a rank of a group that could not
    #   receive its rank 0's outcome of step ``step`` on ``job_ids`` asks whether it committed (then it
    #   applies the step: its gradients are the group's). Answered once the journal is on disk; the
    #   version ``membership`` ends then, so no commit of it can land after a "not committed".
    "step_outcome": ("worker_id", "token", "model", "step", "job_ids", "membership"),
    # {model, step, metrics?} -> {}; the model's state at ``step`` (witness included) is durable on
    # disk (metrics: that step's figures, as commit_step's, when the drafter applied it)
    "checkpoint": ("worker_id", "token", "model", "step"),
    # {} -> {}; leaving cleanly: leased jobs go back at once
    "deregister": ("worker_id", "token"),
    # {} -> {stats snapshot}; served on the read-only stats socket only
    "stats": (),
}

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


class Request(NamedTuple):
    """A checked request (a NamedTuple: a frozen dataclass's init cost a microsecond per request)."""
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
    fields = message.copy()
    del fields["v"], fields["op"]
    fields.pop("id", None)
    return Request(op, request_id, fields)


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
