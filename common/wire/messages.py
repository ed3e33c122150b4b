"""Every control message of hsdispatch as a typed struct: the one place a message's fields are named.

A message is one ZeroMQ frame holding a msgpack map. A request carries the protocol version ``v``,
its ``op`` (the struct's tag) and an ``id`` the sender chose; a reply echoes ``id`` and carries
``ok: true`` and the op's result fields, or ``ok: false`` and ``error: {code, message}``.

The structs are `msgspec <https://jcristharif.com/msgspec/>`_ structs: msgpack-native, and checked
as they are decoded (a field of the wrong type, a missing field, a value out of range is a
``ValidationError`` naming its path, answered ``malformed``). msgpack only: no pickle anywhere, so a
peer can never make another execute code. Unknown fields are ignored, so an older peer's message
with a field more still decodes. A few parts are structs of their own, decoded with the message
that carries them: what a worker claims when it registers (:mod:`common.wire.claims`), the data
plane's descriptors (:mod:`common.run.descriptors`, :mod:`common.run.slot_layout`) and the capture
contract (:mod:`common.run.capture_contract`).

Tensor bytes never travel here: a job names a slot and its generation, and the bytes move through
the hidden-state transport (shared memory, CUDA IPC or NIXL).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from common.run.capture_contract import CaptureContract
from common.run.descriptors import SlotExport, TransportInfo
from common.run.slot_layout import SlotLayout
from common.wire.claims import Count, GroupClaim, ModelClaim, PendingCommit, TargetRank  # noqa: F401 (Register's parts)
from common.wire.errors import ErrorCode, ProtocolError
from common.wire.stats_snapshot import GpuHealth, SlotCopies, Snapshot

PROTOCOL_VERSION = 4  # 3: get_hs carries the consumed reports of the slots copied out since the last poll;
                      # 4: get_job carries the job_ready reports of the slots written since the last poll

MAX_STEP_METRICS = 16  # commit_step's metrics: a few figures for hsd stats, never a payload
StepMetrics = Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], float],
                        msgspec.Meta(max_length=MAX_STEP_METRICS)]


# -- requests ------------------------------------------------------------------------------------

class Struct(msgspec.Struct, kw_only=True):
    """A message part. Every struct here is keyword-only (msgspec does not inherit kw_only), so a
    subclass's required fields may follow its base's defaults."""


class Request(Struct, tag_field="op", kw_only=True):
    v: int = PROTOCOL_VERSION
    id: int = 0
    secret: str | None = None  # dispatcher.secret, when the run sets one


class WorkerRequest(Request, kw_only=True):
    """Every op after ``register`` names the worker and the session token registration returned: a
    request under a registered id without its token is refused (``unauthorized``). The worker's
    session fills both in."""
    worker_id: str = ""
    token: str | None = None


class Register(Request, tag="register", kw_only=True):
    """-> RegisterReply. ``node``: where it runs (default: host); with pool.transport=nixl a target's
    slots live on it and drafters are given their own node's slots first. ``contract``: the capture
    contract the worker produces (target) or expects (drafter); one that differs from the run's is
    refused (incompatible), naming both sides."""
    role: Literal["target", "drafter"]
    name: str
    pid: int
    host: str
    node: str | None = None
    gpu: int | None = None
    contract: CaptureContract | None = None
    model: ModelClaim | None = None  # drafters only
    layout: SlotLayout | None = None  # the slot layout it expects: one that is not the run's is incompatible
    tp_ranks: list[TargetRank] | None = None  # a tensor-parallel target group: its ranks (none talks but rank 0)


class JoinGroup(WorkerRequest, tag="join_group", kw_only=True):
    """-> JoinGroupReply; long-poll for the membership version newer than ``after`` that names this
    rank (after=0: any). ``step``: the model step the rank holds. ``failed``: a collective of version
    ``after`` failed on this rank, which ends that version at once. A rank at a rendezvous asks with
    wait_ms=0 between waits, so it learns at once that its version ended."""
    wait_ms: int
    after: int
    step: int
    failed: bool = False


class RegisterSlots(WorkerRequest, tag="register_slots", kw_only=True):
    """-> Ack; a cuda_ipc target offers the slots it allocated on its GPU, a nixl target those in its
    node's memory. ``ipc_block`` is the transport's own description of them (common/run/descriptors.py)."""
    ipc_block: SlotExport
    num_slots: Count


class Heartbeat(WorkerRequest, tag="heartbeat", kw_only=True):
    """-> Done (with ``membership``); keeps the worker alive (a silent one is declared dead, its jobs given back).
    ``holding``: every job the worker holds (extracting, reading, consumed but not committed);
    ``seen_grant``: the ``grant`` number of the latest job it received. A job the dispatcher thinks
    it holds, granted no later than seen_grant and not listed, is given back at once."""
    holding: list[int]
    seen_grant: int | None = None
    gpu: GpuHealth | None = None  # a worker on a GPU: its memory and compiled graphs
    copies: SlotCopies | None = None  # a worker that copied a slot: its latest copies' times


class ReadyReport(Struct):
    """A job whose slot now holds its hidden states (a job_ready's fields, carried by a get_job)."""
    job_id: int
    generation: int
    busy_s: float


class GetJob(WorkerRequest, tag="get_job", kw_only=True):
    """-> GrantReply; long-poll until a job and a slot are free. ``ready``: slots this target wrote
    since its previous poll, each applied as a :class:`JobReady` before the poll is served (and
    whether or not it is), so a job costs one message, not two; one applied already (this poll sent
    again) is skipped, one refused (the job was given back meanwhile) is logged by the dispatcher
    and the poll answered all the same."""
    wait_ms: int
    ready: list[ReadyReport] = []


class JobReady(WorkerRequest, tag="job_ready", kw_only=True):
    """-> Ack; the slot now holds the job's hidden states (sent alone when no get_job follows at once)."""
    job_id: int
    generation: int
    busy_s: float


class JobFailed(WorkerRequest, tag="job_failed", kw_only=True):
    """-> Ack; the target could not extract the job: it goes back to pending."""
    job_id: int
    reason: str = ""


class GetHS(WorkerRequest, tag="get_hs", kw_only=True):
    """-> GrantReply; long-poll for a ready slot. ``membership``: a group rank's version; a version
    that ended answers group_changed (so a poll sent before a change is void). ``consumed``: jobs
    this drafter copied out since its previous poll, each applied as a :class:`Consumed` before the
    poll is served, so a slot costs one message, not two; one applied already (this poll sent again)
    is skipped, one refused (the job was given back meanwhile) is logged by the dispatcher and the
    poll answered all the same."""
    wait_ms: int
    membership: int | None = None
    consumed: list[int] = []


class Consumed(WorkerRequest, tag="consumed", kw_only=True):
    """-> Ack; the drafter copied the slot out: the slot is free again."""
    job_id: int


class ReadFailed(WorkerRequest, tag="read_failed", kw_only=True):
    """-> Ack; the drafter could not read the slot (stale generation): the job is extracted again."""
    job_id: int
    reason: str = ""


class CommitStep(WorkerRequest, tag="commit_step", kw_only=True):
    """-> CommitReply; the model took optimizer step ``step`` (its previous step + 1) on exactly these
    jobs. Journaled and fsynced before the reply; the same (model, step, job_ids) again gets the
    first answer. A data-parallel group commits once per step (its rank 0, with ``membership``),
    naming every rank's jobs."""
    model: str
    step: int
    job_ids: list[int]
    busy_s: float
    verified: int = 0  # how many of the step's slots a sim drafter checked byte for byte
    # a few named figures of the drafter's previous step (loss and the like) and "step", the one
    # they are of: shown by hsd stats, journaled with the commit
    metrics: StepMetrics | None = None
    sync_wait_s: float = 0.0  # rank 0's wait at the gradient all-reduce
    step_s: float = 0.0
    membership: int | None = None
    # how many of job_ids (or of cost_jobs, an earlier step's on a GPU, whose times come late) each
    # rank trained, in rank order, and its busy seconds: what the step-cost model learns from
    rank_jobs: list[Count] | None = None
    rank_busy_s: list[float] | None = None
    cost_jobs: list[int] | None = None

    def __post_init__(self) -> None:
        if (self.rank_jobs is None) != (self.rank_busy_s is None) or (
                self.rank_jobs is not None and len(self.rank_jobs) != len(self.rank_busy_s)):
            raise ValueError("rank_jobs and rank_busy_s must be lists of equal length")


class StepOutcome(WorkerRequest, tag="step_outcome", kw_only=True):
    """-> OutcomeReply; a rank that could not receive its rank 0's outcome of ``step`` on ``job_ids``
    asks whether it committed. Answered once the journal is on disk; version ``membership`` ends
    then, so no commit of it can land after a "not committed"."""
    model: str
    step: int
    job_ids: list[int]
    membership: int


class Checkpoint(WorkerRequest, tag="checkpoint", kw_only=True):
    """-> Done; the model's state at ``step`` (witness included) is durable on disk (metrics: that
    step's figures, as commit_step's, when the drafter applied it)."""
    model: str
    step: int
    metrics: StepMetrics | None = None


class Deregister(WorkerRequest, tag="deregister", kw_only=True):
    """-> Ack; leaving cleanly: leased jobs go back at once."""


class Stats(Request, tag="stats", kw_only=True):
    """-> StatsReply; served on the read-only stats socket only."""


ControlRequest = Union[Register, JoinGroup, RegisterSlots, Heartbeat, GetJob, JobReady, JobFailed, GetHS, Consumed,
                       ReadFailed, CommitStep, StepOutcome, Checkpoint, Deregister, Stats]
REQUEST_TYPES: dict[str, type[Request]] = {t.__struct_config__.tag: t for t in ControlRequest.__args__}
ROLES = ("target", "drafter")


# -- replies -------------------------------------------------------------------------------------

class Job(Struct, kw_only=True):
    """A job as a worker holds it, from the grant to its report: what to extract (a target) or read
    (a drafter), and where."""
    job_id: int
    epoch: int
    bucket: int
    seq_len: int
    samples: list[int]  # dataset rows
    lengths: list[int]  # their token counts
    num_tokens: int
    slot: int
    generation: int
    owner: str | None = None  # the target whose own slot it is (cuda_ipc, nixl), None for the pool's
    grant: int = 0  # counts 1, 2, ... per session (see Heartbeat.seen_grant)
    ipc: SlotExport | None = None  # get_hs of an owned slot: the owner's ipc_block


class Membership(Struct, kw_only=True):
    """A version of an elastic group, as the rank it names sees it."""
    rank: int
    world_size: int
    membership: int  # the version
    # the version's rendezvous: a FileStore path in the run directory, or "tcp://HOST:PORT/PREFIX",
    # rank 0's TCPStore under a key prefix of the version's own
    store: str
    step: int
    # some rank holds another step than the version's: rank ``source`` sends its state (model,
    # optimizer, scheduler, RNG, witness) to the others over the new group before any step
    source: int | None = None
    transfer: bool = False


class ErrorBody(Struct, kw_only=True):
    code: str
    message: str


class Reply(Struct, kw_only=True):
    v: int = PROTOCOL_VERSION
    id: int | None = None
    ok: bool = True


class ErrorReply(Reply, kw_only=True):
    ok: bool = False
    error: ErrorBody


class Ack(Reply, kw_only=True):
    """The reply of an op with no result."""


class Done(Reply, kw_only=True):
    done: bool  # every epoch committed
    # (heartbeat) the membership version naming a rank of a data-parallel group now, 0 while it names
    # none: a version the rank is in a collective of has ended (a peer died), so it leaves that collective
    membership: int | None = None


class RegisterReply(Reply, kw_only=True):
    worker_id: str
    token: str | None
    run_id: str
    transport: TransportInfo  # the data plane's description for this worker (common/run/descriptors.py)
    heartbeat_s: float
    worker_timeout_s: float
    accum_steps: int
    buckets: list[int]
    epochs: int
    contract: CaptureContract | None = None
    model_step: int | None = None  # a drafter's: the step the ledger now holds for its model
    pending_committed: bool = False  # its pending commit is the ledger's: apply it
    # a drafter's: the jobs of one epoch's schedule; one whose <section>.total_steps is 0 spans its
    # learning-rate schedule over run.epochs of them
    jobs_per_epoch: int | None = None


class JoinGroupReply(Reply, kw_only=True):
    group: Membership | None
    model_step: int
    membership: int  # the version naming the rank now, 0 while it waits for one
    # (only without a group) no live rank holds the committed step and the model's durable
    # checkpoint at step ``reload`` is newer than this rank's state: load it and ask again
    reload: int | None = None


class GrantReply(Reply, kw_only=True):
    job: Job | None
    done: bool
    flush: bool = False  # nothing more is coming for now: commit a partial step
    # a rank of a drafter.step_balance=cost group holds its share of this model step: go to the all-reduce
    step_full: int | None = None


class CommitReply(Reply, kw_only=True):
    step: int
    done: bool
    membership: int | None = None  # the group's version after the commit: a newer one means ranks join here


class OutcomeReply(Reply, kw_only=True):
    committed: bool
    model_step: int


class StatsReply(Reply, kw_only=True):
    stats: Snapshot  # dispatcher/snapshot.py's, with what dispatcher/handlers.py adds


REPLY_TYPES: dict[str, type[Reply]] = {
    "register": RegisterReply, "join_group": JoinGroupReply, "register_slots": Ack, "heartbeat": Done,
    "get_job": GrantReply, "job_ready": Ack, "job_failed": Ack, "get_hs": GrantReply, "consumed": Ack,
    "read_failed": Ack, "commit_step": CommitReply, "step_outcome": OutcomeReply, "checkpoint": Done,
    "deregister": Ack, "stats": StatsReply,
}
assert REPLY_TYPES.keys() == REQUEST_TYPES.keys()


# -- coding ----------------------------------------------------------------------------------------

class _RequestHead(msgspec.Struct):
    """What is read of a request before its op is known: enough to answer bad_version / unknown_op."""
    v: Any = None
    op: Any = None
    id: Any = 0


class _ReplyHead(msgspec.Struct):
    id: Any = None
    ok: Any = False
    error: Any = None


_encoder = msgspec.msgpack.Encoder()
_request_head = msgspec.msgpack.Decoder(_RequestHead)
_reply_head = msgspec.msgpack.Decoder(_ReplyHead)
_request_decoders = {op: msgspec.msgpack.Decoder(kind) for op, kind in REQUEST_TYPES.items()}
_reply_decoders = {op: msgspec.msgpack.Decoder(kind) for op, kind in REPLY_TYPES.items()}
_any = msgspec.msgpack.Decoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def _malformed(exc: Exception, request_id: int | None = None, where: str = "") -> ProtocolError:
    if isinstance(exc, msgspec.ValidationError):
        return ProtocolError(ErrorCode.MALFORMED, f"{where}{exc}", request_id)
    return ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message: {type(exc).__name__}", request_id)


def decode_request(frame: bytes, max_bytes: int | None = None) -> Request:
    """One frame as the request it is, or a ProtocolError naming what is wrong with it."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        head = _request_head.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, "a message must be a msgpack map" if isinstance(
            exc, msgspec.ValidationError) else f"not a msgpack message: {type(exc).__name__}") from None
    request_id = head.id
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError(ErrorCode.MALFORMED, "request id must be an integer")
    if head.v != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"protocol version {head.v!r}, this dispatcher speaks {PROTOCOL_VERSION}", request_id)
    decoder = _request_decoders.get(head.op) if isinstance(head.op, str) else None
    if decoder is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {head.op!r}", request_id)
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _malformed(exc, request_id, f"{head.op}: ") from None


def reply_id(frame: bytes) -> int | None:
    """The request id a reply answers (None: it could not be read, or the request's id could not)."""
    try:
        head = _reply_head.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return head.id if isinstance(head.id, int) and not isinstance(head.id, bool) else None


def decode_reply(frame: bytes, op: str) -> Reply:
    """The reply to a request of ``op``; an error reply (or one that breaks the protocol) is raised
    as ProtocolError."""
    try:
        head = _reply_head.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _malformed(exc) from None
    if head.ok is not True:
        error = head.error if isinstance(head.error, dict) else {}
        raise ProtocolError(str(error.get("code", ErrorCode.INTERNAL)), str(error.get("message", "error reply")))
    try:
        return _reply_decoders[op].decode(frame)
    except msgspec.ValidationError as exc:
        raise _malformed(exc, where=f"reply to {op}: ") from None


def decode_any(frame: bytes) -> Any:
    """A frame as plain msgpack values (the tests' raw frames; a reply whose request is unknown)."""
    return _any.decode(frame)


def error_reply(request_id: int | None, code: str, message: str) -> ErrorReply:
    return ErrorReply(id=request_id, error=ErrorBody(code=code, message=message))


def op_of(request: Request) -> str:
    return type(request).__struct_config__.tag
