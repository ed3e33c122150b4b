"""The stats snapshot as typed structs: what the stats socket's reply carries, ``hsd stats`` shows
and ``/metrics`` exposes of a running dispatcher.

:class:`CoreSnapshot` is what dispatcher/snapshot.py builds from the core; :class:`Snapshot` adds
what only the serving dispatcher knows (its run, process, transport, auth and nodes). Maps keyed
by data (per state, per bucket, per op, per node, per model) stay maps. A field that is ``None``
is left out when encoded (``omit_defaults``), so ``hsd stats --json`` shows only what is there.
Every class names ``kw_only`` itself: msgspec does not inherit it.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Part(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A part of the snapshot."""


class RankView(Part, kw_only=True, omit_defaults=True):
    """One process of a tensor-parallel target group."""
    rank: int
    pid: int
    gpu: int | None = None


class EpochView(Part, kw_only=True, omit_defaults=True):
    """One started epoch's progress."""
    epoch: int  # 0-based
    jobs: int  # the jobs the epoch has
    committed: int  # of them committed
    taken: int  # times a job of it was taken by a drafter (retries count again)
    schedule_prefix_deviation: float  # of the schedule's order, in batches
    consumed_prefix_deviation: float  # of the order drafters consumed it in, in batches
    # total variation distance of the last 10% of the jobs from the epoch's mix; this dispatcher
    # does not fill them (hsd report does): /metrics exposes them when set
    schedule_tail_skew: float | None = None
    consumed_tail_skew: float | None = None


class GpuHealth(Part, kw_only=True, omit_defaults=True):
    """A GPU worker's health, with each heartbeat (a CPU worker sends none): its process's CUDA memory
    (torch's allocator: allocated, reserved, the peak allocated) and the graphs dynamo compiled."""
    memory_allocated_bytes: int
    memory_reserved_bytes: int
    memory_peak_bytes: int
    compiled_graphs: int


class SlotCopies(Part, kw_only=True, omit_defaults=True):
    """The wall time of a worker's latest slot copies, with each heartbeat once it copied one, on a GPU
    or a CPU: a target's write into its slot (device to host, or host to host), a drafter's read out of
    one (IPC included); ms per slot, over the latest :data:`common.worker.gpu_health.COPY_WINDOW`."""
    copies: int  # slot copies timed so far (the percentiles are of the latest ones)
    copy_ms_p50: float
    copy_ms_p99: float


class WorkerView(Part, kw_only=True, omit_defaults=True):
    """One registered worker."""
    id: str
    name: str
    role: str  # target or drafter
    pid: int
    host: str
    gpu: int | None
    state: str  # busy, idle, starved (waiting with nothing to do) or blocked (waiting for a free slot)
    jobs: int  # jobs it finished since it registered
    tokens_per_s: float  # since it registered
    idle_ratio: float  # share of its time it waited, since it registered
    heartbeat_age_s: float  # seconds since it was last heard from
    # cumulative seconds: a viewer differences two snapshots for a recent idle ratio
    alive_s: float
    wait_s: float
    held: list[int]  # the job ids it holds
    metrics: dict[str, float] | None = None  # drafter: its latest step's figures (loss, lr, ...), when it sent any
    rank: int | None = None  # drafter of a data-parallel group: its rank
    membership: int | None = None  # ... and the group's membership version it registered in
    gpu_health: GpuHealth | None = None  # a worker on a GPU: memory, compiled graphs (none on a CPU)
    slot_copies: SlotCopies | None = None  # a worker that copied a slot: its copies' ms per slot
    tp_ranks: list[RankView] | None = None  # target of tensor-parallel ranks: each of them (rank 0 is this worker)


class ModelView(Part, kw_only=True, omit_defaults=True):
    """A model the ledger trains."""
    step: int  # its committed step
    checkpoint: int  # the step of its newest checkpoint the dispatcher knows of


class StepCost(Part, kw_only=True, omit_defaults=True):
    """A group's fitted step cost model (step_balance=cost): seconds per job, sequence, padded token."""
    jobs: float
    sequences: float
    padded_tokens: float
    observations: int  # the steps it was fitted on


class GroupView(Part, kw_only=True, omit_defaults=True):
    """A data-parallel drafter group as a watcher sees it."""
    version: int  # its membership version
    world_size: int  # ranks of its current membership
    formed: bool  # it took its first step's ranks
    step_balance: str  # how a step's jobs are spread over the ranks (count, tokens, cost)
    step_jobs: int  # jobs per step once formed, else 0
    step_cost: StepCost | None = None  # under step_balance=cost, once it has observations
    members: dict[str, str]  # rank (as text) -> worker id
    waiting: int  # ranks waiting to join
    steps_since_change: int  # steps it committed since its membership last changed (0 until formed)


class WaitingModel(Part, kw_only=True, omit_defaults=True):
    """A model whose known checkpoint is behind its step: the run cannot end before it is saved."""
    step: int
    checkpoint: int
    drafters: list[str]  # names of the live drafters that train it


class WaitingFor(Part, kw_only=True, omit_defaults=True):
    """What a run that is not done waits for."""
    epochs: dict[str, dict[str, int]]  # open epoch (as text) -> its jobs by state (states with none left out)
    models: dict[str, WaitingModel]
    workers: list[str]  # names of the workers that hold its jobs or must checkpoint a model
    reasons: list[str]  # a line a person reads for each


class NodeView(Part, kw_only=True, omit_defaults=True):
    """One node of the run: its slots, reservoir, workers and reads."""
    slots: dict[str, int]  # its pool slots by state
    min_ready: int  # ready slots it keeps in reserve
    targets: int
    drafters: int
    reads_local: int  # slots its drafters read from its own node
    reads_remote: int  # ... and from another node's


class DroppedSamples(Part, kw_only=True, omit_defaults=True):
    """Samples longer than the schedule's last bucket: no epoch trains them."""
    count: int
    first: list[int]  # the first few of their sample indices
    longer_than: int  # the last bucket's max length


class TransportView(Part, kw_only=True, omit_defaults=True):
    """The hidden-state transport, as a viewer sizes the pool."""
    kind: str  # shm, cuda_ipc or nixl
    slot_bytes: int
    num_slots: int  # of the pool (shm), of each target (cuda_ipc, nixl)
    pool_bytes: int  # num_slots × slot_bytes
    per_target: bool  # the slots are each target's own (cuda_ipc, nixl)


class AuthView(Part, kw_only=True, omit_defaults=True):
    """How the control socket authenticates (common/wire/curve.py's auth_stats); the counts with CURVE only."""
    mechanism: str  # none, secret or curve
    accepted: int | None = None  # client keys accepted
    refused: int | None = None  # client keys refused
    handshakes_failed: int | None = None


class CoreSnapshot(Part, kw_only=True, omit_defaults=True):
    """What the core knows: built by dispatcher/snapshot.py's build_snapshot."""
    time: float  # wall clock (time.time()) when it was taken
    uptime_s: float
    done: bool  # every epoch committed
    epochs_total: int  # epochs the run trains
    epochs: list[EpochView]  # the started ones
    jobs_by_state: dict[str, int]
    q_hsb: dict[str, int]  # ready slots per bucket (as text: msgpack map keys are str), every bucket
    pool: dict[str, int]  # pool slots by state
    pool_peak_slots: int  # the most slots held at once
    workers: list[WorkerView]
    steps: int  # committed optimizer steps
    models: dict[str, ModelView]  # model id -> its step and checkpoint
    groups: dict[str, GroupView]  # model id -> its data-parallel group
    membership_version: int | None = None  # the newest group membership version, when there is a group
    given_back: dict[str, int]  # jobs given back, by reason
    requests: dict[str, int]  # requests, by op
    errors: dict[str, int]  # error replies, by code
    waiting_for: WaitingFor | None = None  # while the run is not done
    lease_expiries: int | None = None  # leases that expired; not filled here: /metrics derives it from the give-backs
    # share of the steps committed since this dispatcher started that took a new bucket at every pull
    # where an eligible new one was ready (None before the first)
    step_mix: float | None = None
    dropped_samples: DroppedSamples | None = None  # when the data holds samples too long for the schedule


class Snapshot(CoreSnapshot, kw_only=True, omit_defaults=True):
    """The stats reply: the core's snapshot and what the serving dispatcher adds (dispatcher/handlers.py)."""
    run_dir: str
    run_id: str
    pid: int  # the dispatcher's process
    transport: TransportView
    waiters: int  # long polls waiting for an answer
    auth: AuthView
    nodes: dict[str, NodeView]  # node -> its view
    # the socket loop thread's CPU seconds by what they went to: a request's op, or poll, serve,
    # expire, sweep, durable, stats (dispatcher/loop_cpu.py)
    loop_cpu_s: dict[str, float] = {}
    loop_wakeups: int = 0  # the socket loop's wake-ups (its poller's returns) since it started


def serving_snapshot(core: CoreSnapshot, **served: Any) -> Snapshot:
    """The stats reply: ``core`` (build_snapshot's, its parts as they are) and the fields the serving
    dispatcher adds."""
    return Snapshot(**msgspec.structs.asdict(core), **served)


def to_json_object(snapshot: CoreSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON-ready values (what ``hsd stats --json`` prints)."""
    return msgspec.to_builtins(snapshot)
