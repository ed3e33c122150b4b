"""The run configuration's sections: one typed dataclass per section of the YAML file, each key a
field (its type hint, default and help line), each section checking its own rules when it is built
(:class:`common.run.config.fields.Section`), and :class:`Config`, the sections together.

A choice is a ``Literal``: its values are written here once, and a component that needs them takes
them from the type (``typing.get_args(Transport)``) rather than listing them again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.run.config.fields import ConfigError, Section, opt
from common.run.drafter_family import DEFAULT_OBJECTIVE

CaptureDtype = Literal["bfloat16", "float16", "float32"]  # target.dtype is one of these or auto; a capture contract's dtype


@dataclass
class RunSection(Section):
    section = "run"
    dir: str = opt("runs/demo", "Run directory: resolved config, schedules, journal, sockets, logs.")
    epochs: int = opt(1, "Number of epochs to train.")
    seed: int = opt(0, "Run seed; the seed of epoch e is derived from it and e.")
    min_free_mb: int = opt(0, "Free space run.dir must have for a run to start, in MiB; 0: the largest checkpoint "
                              "already there plus 64 MiB of journal headroom.")

    def check(self) -> None:
        self.require_positive("epochs")
        if self.min_free_mb < 0:
            raise ConfigError("run.min_free_mb must be >= 0")


@dataclass
class DataSection(Section):
    section = "data"
    lengths: str = opt("", "Lengths file (one sequence length per line) used as the samples of a sim run.")
    path: str = opt("", "Prepared dataset directory (tokenized samples); empty with no lengths file = synthetic.")
    synthetic_samples: int = opt(3000, "Number of samples in the built-in synthetic length distribution.")
    allow_changed: bool = opt(False, "Resume a run directory although its data changed (its schedules index the old samples).")

    def check(self) -> None:
        if self.lengths and self.path:
            raise ConfigError("data.lengths and data.path are exclusive: give one")


Order = Literal["interleave", "shuffle"]
Batching = Literal["sorted", "fixed"]


@dataclass
class ScheduleSection(Section):
    section = "schedule"
    buckets: list[int] = opt([128, 256, 512, 1024, 2048, 4096], "Bucket max lengths, ascending.")
    tokens_per_batch: int = opt(8192, "Token budget of every batch and slot, padding included (see schedule.batching).")
    batching: Batching = opt("sorted", "Batch formation: sorted (a bucket's samples sorted by length, cut into batches of at most tokens_per_batch tokens padded to each batch's longest) or fixed (tokens_per_batch // L sequences padded to the bucket's L; for comparison).")
    order: Order = opt("interleave", "Job order: interleave (largest deficit) or shuffle (plain random, for comparison).")
    assignment: Literal["shared", "per_target"] = opt("shared", "Job queues: shared (any target takes the next job) or per_target (job i only to target i mod target.count; naive, for comparison).")

    def check(self) -> None:
        buckets = self.buckets
        if not buckets or any(b <= 0 for b in buckets) or buckets != sorted(set(buckets)):
            raise ConfigError(f"schedule.buckets: expected positive lengths in strictly ascending order, got {buckets}")
        if self.tokens_per_batch < buckets[-1]:
            raise ConfigError(f"schedule.tokens_per_batch ({self.tokens_per_batch}) must hold at least one sequence "
                              f"of the longest bucket ({buckets[-1]})")


Pull = Literal["deficit", "random"]
Transport = Literal["auto", "shm", "cuda_ipc", "nixl"]


@dataclass
class PoolSection(Section):
    section = "pool"
    slots: int = opt(16, "Number of hidden-state slots (each holds one batch); bounds memory.")
    min_ready: int = opt(6, "Drafters are served only while this many slots are ready, except at an epoch's tail.")
    target_credits: int = opt(2, "Slots one target may hold while extracting (its prefetch depth).")
    pull: Pull = opt("deficit", "Pull policy: deficit (largest consumption deficit) or random (naive, for comparison).")
    transport: Transport = opt("auto", "Hidden-state transport: auto, shm or cuda_ipc (one node), or nixl (across nodes: each target holds its share of pool.slots in its own node's memory, as with cuda_ipc).")

    def check(self) -> None:
        self.require_positive("slots", "target_credits")
        self.require_not_negative("min_ready")
        if self.min_ready >= self.slots:
            raise ConfigError(f"pool.min_ready ({self.min_ready}) must be below pool.slots ({self.slots})")


@dataclass
class DispatcherSection(Section):
    section = "dispatcher"
    endpoint: str = opt("", "Control endpoint; empty = ipc://<run.dir>/control.sock.")
    stats_endpoint: str = opt("", "Read-only stats endpoint; empty = ipc://<run.dir>/stats.sock.")
    secret: str = opt("", "Shared secret; required when binding TCP on a non-loopback address.")
    heartbeat_s: float = opt(0.5, "Interval between worker heartbeats.")
    worker_timeout_s: float = opt(5.0, "A worker silent this long is declared dead and its jobs are given back.")
    lease_s: float = opt(600.0, "Longest a target may extract, or a drafter copy out, one job before it is given back.")
    max_message_bytes: int = opt(1 << 20, "Largest accepted control message; larger ones get an error reply.")
    metrics_port: int = opt(0, "Port of the Prometheus /metrics endpoint; 0 = off.")
    metrics_host: str = opt("127.0.0.1", "Address the /metrics endpoint binds.")
    exit_when_done: bool = opt(True, "Exit after the last epoch is committed and the workers have left.")
    reconnect_s: float = opt(60.0, "How long a worker keeps asking a dispatcher that does not answer (restarting, or its pod rescheduled) before it gives up; time the worker itself was paused (SIGSTOP, a suspended host) does not count. Raise it where a dispatcher takes longer to come back.")
    abandoned_model_s: float = opt(0.0, "Once every job is committed: how long a model that no drafter trains may lag its checkpoint in the run directory before it goes back to it, and the live drafters train the jobs of its later steps (a drafter whose dispatcher restarted registers again within dispatcher.reconnect_s, or has given up); 0 = dispatcher.reconnect_s.")

    @property
    def abandoned_after_s(self) -> float:
        """``abandoned_model_s``, or the reconnect window when it is 0: a drafter cut off from its
        dispatcher is given up on once it would have given up itself."""
        return self.abandoned_model_s or self.reconnect_s

    def check(self) -> None:
        self.require_positive("max_message_bytes")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"dispatcher.metrics_port: {self.metrics_port} is not a port number")
        self.require_positive("heartbeat_s", "worker_timeout_s", "lease_s", "reconnect_s")
        self.require_not_negative("abandoned_model_s")
        if self.worker_timeout_s <= self.heartbeat_s:
            raise ConfigError("dispatcher.worker_timeout_s must exceed dispatcher.heartbeat_s")


@dataclass
class CurveSection(Section):
    section = "curve"
    server_public_key: str = opt("", "The dispatcher's CURVE public key (its Z85 text or its .key file): every worker and hsd stats encrypt to it. Empty = CURVE off (the default; ipc:// on one node needs none).")
    server_secret_key: str = opt("", "The dispatcher's .key_secret file (read on the dispatcher's node only).")
    client_secret_key: str = opt("", "This worker's .key_secret file: its key pair, whose public half the dispatcher must allow.")
    allowed_client_keys: list[str] = opt([], "Public keys the dispatcher accepts: Z85 texts, .key files or directories of .key files.")

    @property
    def enabled(self) -> bool:
        return bool(self.server_public_key)


Locality = Literal["prefer", "any"]


@dataclass
class NodesSection(Section):
    section = "nodes"
    name: str = opt("", "This process's node, which a worker names when it registers (hsd target/drafter --node); empty = the hostname.")
    locality: Locality = opt("prefer", "prefer: a drafter reads its own node's slots first, another node's only when the fairness bound or its starvation asks for it; any: no preference.")
    remote_after_s: float = opt(0.0, "With locality=prefer: how long a drafter with no eligible slot on its node waits before it reads another node's.")

    def check(self) -> None:
        self.require_not_negative("remote_after_s")


def _check_gpus(section: TargetSection | DrafterSection) -> None:
    per_worker = getattr(section, "tp_size", 1)
    if section.gpus and per_worker > 1:
        if len(section.gpus) % per_worker:
            raise ConfigError(f"{section.key('gpus')} lists {len(section.gpus)} GPUs, not a multiple of "
                              f"{section.key('tp_size')}={per_worker}: each target group takes {per_worker} of them")
        if len(section.gpus) < section.count * per_worker:
            raise ConfigError(f"{section.key('gpus')} lists {len(section.gpus)} GPUs for {section.key('count')}="
                              f"{section.count} groups of {section.key('tp_size')}={per_worker} "
                              f"({section.count * per_worker} GPUs)")
    if section.gpus and len(section.gpus) < section.count:
        raise ConfigError(f"{section.key('gpus')} lists {len(section.gpus)} GPUs for "
                          f"{section.key('count')}={section.count}")


@dataclass
class TargetSection(Section):
    section = "target"
    model: str = opt("", "Local Hugging Face model directory of the target.")
    count: int = opt(1, "Target workers started by hsd launch (with tp_size > 1: target groups).")
    gpus: list[int] = opt([], "GPU ids for the targets (one per worker; tp_size per group, a group's consecutive); empty = CPU.")
    tp_size: int = opt(1, "Processes (GPUs) of one target under tensor parallelism: the model's weights split tp_size ways by the Hugging Face tensor-parallel plan of its architecture; the group is one target to the dispatcher.")
    tp_timeout_s: float = opt(120.0, "Longest a rank of a target group waits in a collective of a forward (a rank that died or hangs) before the group's incarnation ends.")
    sim: bool = opt(False, "Start simulated targets (modeled cost, real protocol and data plane).")
    sim_cost_per_token: float = opt(2e-6, "Seconds a sim target spends per token.")
    sim_cost_attention: float = opt(0.0, "Seconds a sim target spends per sequence per squared bucket length (attention).")
    capture_layers: list[int] = opt([], "Captured decoder layers (i = output of decoder layer i); empty = DFlash default.")
    hidden_size: int = opt(64, "Hidden size of the captured states (sim; real models read it from the model).")
    num_capture_layers: int = opt(5, "Captured target layers K of the DFlash default (ignored when capture_layers is set).")
    allow_unservable: bool = opt(False, "Accept capture layers no serving engine feeds a drafter (the last layer's output): for a drafter only hsd eval runs.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = opt("auto", "Attention kernel of the target forward (Hugging Face attn_implementation); auto = the fastest the architecture supports here: flash attention on a GPU where installed, else sdpa, else eager.")
    dtype: Literal["auto", CaptureDtype] = opt("auto", "Dtype of the target forward and captured states; auto = float32 for a model on CPU, else bfloat16.")
    max_restarts: int = opt(3, "Restarts hsd launch grants a crashed target.")

    def check(self) -> None:
        self.require_positive("hidden_size", "num_capture_layers", "tp_size", "tp_timeout_s")
        self.require_not_negative("count", "sim_cost_per_token", "sim_cost_attention")
        _check_gpus(self)
        layers = self.capture_layers
        if layers and (layers[0] < 0 or layers != sorted(set(layers))):
            raise ConfigError(f"target.capture_layers: expected distinct layer ids >= 0 in ascending order, "
                              f"got {layers}")


Objective = str  # a registered drafter family's name (common.run.drafter_family)
ElasticBatch = Literal["tokens", "ranks"]
StepBalance = Literal["cost", "count"]


@dataclass
class DrafterSection(Section):
    section = "drafter"
    count: int = opt(1, "Drafter workers started by hsd launch.")
    gpus: list[int] = opt([], "GPU ids for the drafters (one per worker); empty = CPU.")
    sim: bool = opt(False, "Start simulated drafters (modeled cost, real protocol and data plane).")
    sim_cost_per_token: float = opt(1e-6, "Seconds a sim drafter spends per token.")
    sim_cost_per_sequence: float = opt(0.0, "Seconds a sim drafter spends per sequence (its anchors' blocks); a drafter.backend=linear drafter spends them too, on top of its own compute (a modeled DFlash cost for benchmarks).")
    accum_steps: int = opt(4, "Micro-batches per optimizer step (gradient accumulation).")
    checkpoint_every: int = opt(50, "Optimizer steps between checkpoints (one is also saved when the run drains).")
    checkpoint_keep: int = opt(3, "Checkpoints kept per model; older step directories are removed.")
    max_restarts: int = opt(3, "Restarts hsd launch grants a crashed drafter.")
    backend: Literal["dflash", "linear"] = opt("dflash", "What a real (non-sim) drafter runs: dflash (a drafter model of drafter.objective), or linear (a one-layer model on the captured states, for tests).")
    objective: Objective = opt(DEFAULT_OBJECTIVE, "Drafter a real drafter trains: dflash (block diffusion, the default) or eagle3 (EAGLE-3: one layer, training-time test), or a family named in HSD_DRAFTER_FAMILIES; it sets the capture contract's defaults.")
    data_parallel: bool = opt(True, "With count > 1, real drafters train one model as a torch.distributed group (sim drafters always train a model each).")
    model: str = opt("drafter", "Id of the model a data-parallel group trains (its checkpoints live in run.dir/models/<model>).")
    collective_timeout_s: float = opt(60.0, "Longest a rank waits in a collective (gradient all-reduce, group rendezvous) before it gives the step up.")
    group_wait_s: float = opt(600.0, "Longest a rank of a data-parallel group waits for a membership that lets it train (enough ranks to start, or min_ranks after losses); past it the rank exits with an error instead of waiting for peers lost for good.")
    min_ranks: int = opt(1, "Fewest ranks a data-parallel group trains with once it started; below it the survivors wait (at most group_wait_s) for ranks to join.")
    max_ranks: int = opt(0, "Most ranks a data-parallel group takes (drafters attached beyond it wait for room); 0 = no bound. With count=1, max_ranks > 1 makes the one drafter a group that others can attach to.")
    rendezvous: Literal["auto", "file", "tcp"] = opt("auto", "Where the ranks of a data-parallel group meet for each membership version: file (a FileStore in run.dir/groups, a directory every rank must see), tcp (a TCPStore each rank hosts, the version's rank 0's is used: ranks on nodes that share no directory); auto = tcp with pool.transport=nixl, else file.")
    rendezvous_host: str = opt("", "With drafter.rendezvous=tcp: the address this rank's store binds and advertises (gloo's interface too, unless GLOO_SOCKET_IFNAME is set); empty = this host's address on the route to dispatcher.endpoint (127.0.0.1 for ipc://).")
    elastic_batch: ElasticBatch = opt("tokens", "A step's size when the world size changes: tokens = accum_steps x count micro-batches a step, shared among the ranks (each takes at least one); ranks = accum_steps per rank, the step grows with the group.")
    step_balance: StepBalance = opt("cost", "How a group step's micro-batches are shared among its ranks: cost = each rank takes micro-batches until it holds its share of the step's estimated cost (the dispatcher fits a cost per job from the ranks' measured compute times), so no rank waits long for a slower one at the all-reduce; count = each rank takes the same number.")

    def check(self) -> None:
        from common.run.drafter_family import family_of
        family_of(self.objective)  # a ConfigError naming the known families
        self.require_positive("accum_steps", "checkpoint_every", "checkpoint_keep")
        self.require_not_negative("count", "sim_cost_per_token", "sim_cost_per_sequence")
        self.require_positive("collective_timeout_s", "group_wait_s")
        if self.min_ranks < 1:
            raise ConfigError("drafter.min_ranks must be at least 1")
        if self.max_ranks < 0:
            raise ConfigError("drafter.max_ranks must not be negative (0 = no bound)")
        if self.min_ranks > max(1, self.count):
            raise ConfigError(f"drafter.min_ranks ({self.min_ranks}) must not exceed drafter.count ({self.count}): "
                              f"a new group starts with count ranks")
        if self.max_ranks and self.max_ranks < self.count:
            raise ConfigError(f"drafter.max_ranks ({self.max_ranks}) must be 0 (no bound) or at least drafter.count "
                              f"({self.count})")
        host = self.rendezvous_host
        if host and (any(c.isspace() or c in "/[]" for c in host) or host.count(":") == 1):
            raise ConfigError(f"drafter.rendezvous_host: expected a host name or IP address (no port), got {host!r}")
        if self.model:
            from common.run.witness import check_model_id  # here: reading a config needs no msgspec (hsd bench gpu's preflight)
            try:
                check_model_id(self.model)
            except ValueError as exc:
                raise ConfigError(f"drafter.model: {exc}") from None
        _check_gpus(self)

    @property
    def grouped(self) -> bool:
        """Real drafters of one model train as ranks of one elastic data-parallel group."""
        return self.data_parallel and not self.sim and (self.count > 1 or self.max_ranks > 1)

    @property
    def group_size(self) -> int:
        """Ranks a new data-parallel group waits for before its first step (1: a lone drafter)."""
        return max(1, self.count) if self.grouped else 1

    def rank_accum_steps(self, *, rank: int, world_size: int) -> int:
        """Micro-batches ``rank`` brings to a step of a ``world_size``-rank group: its count-balanced
        share (``elastic_batch``), or with ``step_balance=cost`` as many as the whole step holds (the
        dispatcher says when the rank has its share)."""
        total = step_jobs(self.accum_steps, self.count, world_size, self.elastic_batch)
        if self.step_balance == "cost":
            return total
        if self.elastic_batch == "ranks":
            return self.accum_steps
        return max(1, total // world_size + (rank < total % world_size))

    def exchange_width(self, world_size: int) -> int:
        """Job ids a rank's row of the job exchange holds: the largest share of any rank (rank 0's),
        the same on every rank of the group (collectives need equal sizes)."""
        return self.rank_accum_steps(rank=0, world_size=world_size)


def step_jobs(accum_steps: int, count: int, world_size: int, elastic_batch: ElasticBatch) -> int:
    """Micro-batches of one step of a ``world_size``-rank group: ``accum_steps x count`` shared
    among the ranks (``tokens``; each rank takes at least one) or ``accum_steps`` per rank (``ranks``)."""
    if elastic_batch == "ranks":
        return accum_steps * world_size
    return max(accum_steps * max(1, count), world_size)


@dataclass
class TrainingRecipe(Section):
    """The optimizer, schedule and precision keys every drafter section has (the trainer's recipe;
    :func:`drafter_worker.recipe.validate_recipe` checks what a training run needs beyond these rules)."""
    lr: float = opt(6e-4, "Peak AdamW learning rate.")
    betas: list[float] = opt([0.9, 0.95], "AdamW betas.")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay.")
    warmup_ratio: float = opt(0.04, "Share of the total steps spent warming the learning rate up linearly.")
    min_lr_ratio: float = opt(0.0, "Floor of the cosine decay, as a fraction of lr.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this; 0 = no clipping.")
    total_steps: int = opt(0, "Length of the cosine schedule in steps of accum_steps x drafter.count jobs; the schedule advances by the jobs each step trained, so a changing world size does not shift it. 0 = every job of every epoch.")
    loss_chunk_size: int = opt(4096, "Positions whose logits are computed at once (bounds the logits' memory).")
    dtype: Literal["auto", "bfloat16", "float32"] = opt("auto", "Compute dtype: auto (bfloat16 autocast on GPU, float32 on CPU), bfloat16 or float32.")
    export_dtype: Literal["auto", CaptureDtype] = opt("auto", "Dtype of the exported drafter weights; auto = the compute dtype.")
    log_every: int = opt(1, "Optimizer steps between two metric log lines.")

    def check(self) -> None:
        self.require_positive("lr", "log_every")
        self.require_not_negative("total_steps")


def family_section_types() -> dict[str, type]:
    """The config section of every registered drafter family, by name."""
    from common.run.drafter_family import families
    return {family.section_name: family.section for family in families()}


def section_types() -> dict[str, type]:
    """Every section of a config file by name: :class:`Config`'s, then the drafter families'."""
    import typing
    return {**typing.get_type_hints(Config), **family_section_types()}


def model_keys(keys_type: type, section: Any) -> dict[str, Any]:
    """The values of ``keys_type``'s fields (a drafter family's model keys, e.g.
    :class:`drafter_worker.dflash.section.DFlashModelKeys`) in ``section``: what a model config takes
    from its section."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(keys_type)}


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    pool: PoolSection = field(default_factory=PoolSection)
    dispatcher: DispatcherSection = field(default_factory=DispatcherSection)
    curve: CurveSection = field(default_factory=CurveSection)
    nodes: NodesSection = field(default_factory=NodesSection)
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)

    def __post_init__(self) -> None:
        # Each drafter family's own section (dflash, eagle3, ...), reached as config.<name> like the
        # sections above; load_config replaces them with the file's values (:meth:`with_family_sections`).
        self.family_sections: dict[str, Section] = {name: section_type()
                                                    for name, section_type in family_section_types().items()}

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("family_sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__!r} has no section {name!r}")

    def with_family_sections(self, sections: dict[str, Section]) -> Config:
        self.family_sections.update(sections)
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        doc = dataclasses.asdict(self)
        doc.update({name: dataclasses.asdict(section) for name, section in self.family_sections.items()})
        return doc

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def control_endpoint(self) -> str:
        return self.dispatcher.endpoint or f"ipc://{self.run_dir / 'control.sock'}"

    @property
    def stats_endpoint(self) -> str:
        return self.dispatcher.stats_endpoint or f"ipc://{self.run_dir / 'stats.sock'}"

    @property
    def group_rendezvous(self) -> str:
        """file or tcp: drafter.rendezvous, auto resolved (a run across nodes shares no directory)."""
        if self.drafter.rendezvous != "auto":
            return self.drafter.rendezvous
        return "tcp" if self.pool.transport == "nixl" else "file"


