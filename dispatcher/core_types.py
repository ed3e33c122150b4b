"""What the dispatcher's core hands around: its options, a worker's session record, a grant, the
counters, and the errors its ops raise. Plain data, no decisions (those are in ``dispatcher/core.py``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.run.capture_contract import CaptureContract
from common.run.config import Config, Objective, TargetSection
from common.run.descriptors import SlotExport
from common.wire import messages
from common.wire.client import RECONNECT_S
from dispatcher.groups import Membership
from dispatcher.ledger import Job


class UnknownWorker(KeyError):
    pass


class Unauthorized(PermissionError):
    """A request under a registered worker id without that worker's session token."""


class Incompatible(ValueError):
    """A worker that cannot serve this run (its capture contract differs from the run's)."""


DONE = "done"  # get_job / get_hs result once every epoch is committed
STEP_FULL = "step_full"  # get_hs result for a group rank that holds its share of the step (step_balance=cost)


@dataclass
class Worker:
    id: str
    role: str
    name: str
    pid: int
    host: str
    gpu: int | None
    registered_at: float
    last_seen: float
    waiting_since: float | None = None
    wait_reason: str = ""
    total_wait_s: float = 0.0
    num_tokens: int = 0
    num_jobs: int = 0
    window_avail: int | None = None  # drafter: buckets eligible when its accumulation window opened
    window_mixed: bool = True  # drafter: every pull of the window took a new bucket when one was eligible
    ipc_block: SlotExport | None = None  # target on cuda_ipc or nixl: how drafters open its slots
    slot_base: int = 0
    token: str = ""
    model: str | None = None  # drafter: the model it trains
    group: Membership | None = None  # drafter of a data-parallel group: its rank at registration
    num_grants: int = 0  # jobs handed to this session so far: each grant carries its number
    queue: int | None = None  # target under schedule.assignment=per_target: the queue it takes from
    metrics: dict[str, float] = field(default_factory=dict)  # drafter: its latest step's figures (loss, lr, ...)
    node: str = ""  # the node it runs on (register's ``node``, default its host)
    pending_committed: bool = False  # drafter: the step it registered as pending had committed: it applies it
    gpu_health: messages.GpuHealth | None = None  # a GPU worker's latest heartbeat's figures (memory, graphs)
    slot_copies: messages.SlotCopies | None = None  # its latest heartbeat's slot copy times (GPU or CPU)
    tp_ranks: list[tuple[int, int, int | None]] = field(default_factory=list)  # target group: (rank, pid, gpu)


@dataclass
class JobGrant:
    job: Job
    slot: int  # index inside the slot owner's memory
    owner: str | None
    seq_len: int
    samples: list[int]
    lengths: list[int]
    grant_seq: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def to_wire(self, *, ipc_block: SlotExport | None = None) -> messages.Job:
        job = self.job
        return messages.Job(job_id=job.job_id, epoch=job.epoch, bucket=job.bucket, seq_len=self.seq_len,
                            samples=self.samples, lengths=self.lengths, num_tokens=self.num_tokens, slot=self.slot,
                            generation=job.generation, owner=self.owner, grant=self.grant_seq, ipc=ipc_block)


@dataclass
class CoreOptions:
    lease_s: float
    worker_timeout_s: float
    epochs: int
    run_seed: int
    buckets: list[int]
    tokens_per_batch: int
    order: str
    batching: str = "sorted"
    heartbeat_s: float = 0.5
    build_ahead: bool = False  # build the next epoch's schedule in a child process (the daemon) or inline (tests)
    allow_changed_data: bool = False
    contract: CaptureContract | None = None  # the run's capture contract, when the config fixes it
    num_target_queues: int = 0  # > 0: per-target queues (job i to queue i mod this), the naive assignment
    abandoned_model_s: float = RECONNECT_S  # the dispatcher section's abandoned_after_s

    @classmethod
    def from_config(cls, config: Config) -> "CoreOptions":
        return cls(lease_s=config.dispatcher.lease_s, worker_timeout_s=config.dispatcher.worker_timeout_s,
                   epochs=config.run.epochs, run_seed=config.run.seed, buckets=list(config.schedule.buckets),
                   tokens_per_batch=config.schedule.tokens_per_batch, order=config.schedule.order,
                   batching=config.schedule.batching, heartbeat_s=config.dispatcher.heartbeat_s, build_ahead=True,
                   allow_changed_data=config.data.allow_changed,
                   contract=run_contract(config.target, config.drafter.objective),
                   num_target_queues=config.target.count if config.schedule.assignment == "per_target" else 0,
                   abandoned_model_s=config.dispatcher.abandoned_after_s)


def run_contract(target: TargetSection, objective: Objective) -> CaptureContract | None:
    """The capture contract the run's slots are laid out for: from the target model's config.json when
    the run has a real target; None for a sim run (then the first worker that declares one sets it).
    ``objective``: the run's ``drafter.objective``."""
    if target.sim or not target.model:
        return None
    from common.run.capture_contract import contract_of
    return contract_of(target, objective)


@dataclass
class Counters:
    requests: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    given_back: Counter = field(default_factory=Counter)
    reads: Counter = field(default_factory=Counter)  # (reader's node, "local" | "remote") -> slots handed out
    steps: int = 0  # optimizer steps committed since this dispatcher started
    mixed_steps: int = 0  # ... of which took a new bucket at every pull where an eligible new one was ready
