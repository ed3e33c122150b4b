"""Run configuration: one YAML file, one typed dataclass per section.

Every subcommand takes ``--config FILE`` plus ``section.key=value`` overrides. Unknown sections or
keys and ill-typed values raise :class:`ConfigError` naming the key. The resolved configuration is
written into the run directory so that every process of a run (and a later resume) sees the same
values.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.capture_contract import contract_from_config, read_model_config
from common.durable import atomic_write
from common.serving_layers import unservable_reason
from common.witness import check_model_id


class ConfigError(ValueError):
    """A configuration value a user can get wrong: the message names the key."""


def opt(default: Any, help: str) -> Any:
    """A config field with a default and a one-line description (shown by ``hsd config``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class RunSection:
    dir: str = opt("runs/demo", "Run directory: resolved config, schedules, journal, sockets, logs.")
    epochs: int = opt(1, "Number of epochs to train.")
    seed: int = opt(0, "Run seed; the seed of epoch e is derived from it and e.")


@dataclass
class DataSection:
    lengths: str = opt("", "Lengths file (one sequence length per line) used as the samples of a sim run.")
    path: str = opt("", "Prepared dataset directory (tokenized samples); empty with no lengths file = synthetic.")
    synthetic_samples: int = opt(3000, "Number of samples in the built-in synthetic length distribution.")
    allow_changed: bool = opt(False, "Resume a run directory although its data changed (its schedules index the old samples).")


@dataclass
class ScheduleSection:
    buckets: list[int] = opt([128, 256, 512, 1024, 2048, 4096], "Bucket max lengths, ascending.")
    tokens_per_batch: int = opt(8192, "Token budget of every batch and slot, padding included (see schedule.batching).")
    batching: str = opt("sorted", "Batch formation: sorted (a bucket's samples sorted by length, cut into batches of at most tokens_per_batch tokens padded to each batch's longest) or fixed (tokens_per_batch // L sequences padded to the bucket's L; for comparison).")
    order: str = opt("interleave", "Job order: interleave (largest deficit) or shuffle (plain random, for comparison).")
    assignment: str = opt("shared", "Job queues: shared (any target takes the next job) or per_target (job i only to target i mod target.count; naive, for comparison).")


@dataclass
class PoolSection:
    slots: int = opt(16, "Number of hidden-state slots (each holds one batch); bounds memory.")
    min_ready: int = opt(6, "Drafters are served only while this many slots are ready, except at an epoch's tail.")
    target_credits: int = opt(2, "Slots one target may hold while extracting (its prefetch depth).")
    pull: str = opt("deficit", "Pull policy: deficit (largest consumption deficit) or random (naive, for comparison).")
    transport: str = opt("auto", "Hidden-state transport: auto, shm or cuda_ipc (one node), or nixl (across nodes: each target holds its share of pool.slots in its own node's memory, as with cuda_ipc).")


@dataclass
class DispatcherSection:
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


@dataclass
class CurveSection:
    server_public_key: str = opt("", "The dispatcher's CURVE public key (its Z85 text or its .key file): every worker and hsd stats encrypt to it. Empty = CURVE off (the default; ipc:// on one node needs none).")
    server_secret_key: str = opt("", "The dispatcher's .key_secret file (read on the dispatcher's node only).")
    client_secret_key: str = opt("", "This worker's .key_secret file: its key pair, whose public half the dispatcher must allow.")
    allowed_client_keys: list[str] = opt([], "Public keys the dispatcher accepts: Z85 texts, .key files or directories of .key files.")

    @property
    def enabled(self) -> bool:
        return bool(self.server_public_key)


@dataclass
class NodesSection:
    name: str = opt("", "This process's node, which a worker names when it registers (hsd target/drafter --node); empty = the hostname.")
    locality: str = opt("prefer", "prefer: a drafter reads its own node's slots first, another node's only when the fairness bound or its starvation asks for it; any: no preference.")
    remote_after_s: float = opt(0.0, "With locality=prefer: how long a drafter with no eligible slot on its node waits before it reads another node's.")


@dataclass
class TargetSection:
    model: str = opt("", "Local Hugging Face model directory of the target.")
    count: int = opt(1, "Target workers started by hsd launch.")
    gpus: list[int] = opt([], "GPU ids for the targets (one per worker); empty = CPU.")
    sim: bool = opt(False, "Start simulated targets (modeled cost, real protocol and data plane).")
    sim_cost_per_token: float = opt(2e-6, "Seconds a sim target spends per token.")
    sim_cost_attention: float = opt(0.0, "Seconds a sim target spends per sequence per squared bucket length (attention).")
    capture_layers: list[int] = opt([], "Captured decoder layers (i = output of decoder layer i); empty = DFlash default.")
    hidden_size: int = opt(64, "Hidden size of the captured states (sim; real models read it from the model).")
    num_capture_layers: int = opt(5, "Captured target layers K of the DFlash default (ignored when capture_layers is set).")
    allow_unservable: bool = opt(False, "Accept capture layers no serving engine feeds a drafter (the last layer's output): for a drafter only hsd eval runs.")
    attn_implementation: str = opt("auto", "Attention kernel of the target forward (Hugging Face attn_implementation); auto = the fastest the architecture supports here: flash attention on a GPU where installed, else sdpa, else eager.")
    dtype: str = opt("auto", "Dtype of the target forward and captured states; auto = float32 for a model on CPU, else bfloat16.")
    max_restarts: int = opt(3, "Restarts hsd launch grants a crashed target.")


@dataclass
class DrafterSection:
    count: int = opt(1, "Drafter workers started by hsd launch.")
    gpus: list[int] = opt([], "GPU ids for the drafters (one per worker); empty = CPU.")
    sim: bool = opt(False, "Start simulated drafters (modeled cost, real protocol and data plane).")
    sim_cost_per_token: float = opt(1e-6, "Seconds a sim drafter spends per token.")
    sim_cost_per_sequence: float = opt(0.0, "Seconds a sim drafter spends per sequence (its anchors' blocks); a drafter.backend=linear drafter spends them too, on top of its own compute (a modeled DFlash cost for benchmarks).")
    accum_steps: int = opt(4, "Micro-batches per optimizer step (gradient accumulation).")
    checkpoint_every: int = opt(50, "Optimizer steps between checkpoints (one is also saved when the run drains).")
    checkpoint_keep: int = opt(3, "Checkpoints kept per model; older step directories are removed.")
    max_restarts: int = opt(3, "Restarts hsd launch grants a crashed drafter.")
    backend: str = opt("dflash", "What a real (non-sim) drafter runs: dflash (a drafter model of drafter.objective), or linear (a one-layer model on the captured states, for tests).")
    objective: str = opt("dflash", "Drafter a real drafter trains: dflash (block diffusion, the default) or eagle3 (EAGLE-3: one layer, training-time test); it sets the capture contract's defaults.")
    data_parallel: bool = opt(True, "With count > 1, real drafters train one model as a torch.distributed group (sim drafters always train a model each).")
    model: str = opt("drafter", "Id of the model a data-parallel group trains (its checkpoints live in run.dir/models/<model>).")
    collective_timeout_s: float = opt(60.0, "Longest a rank waits in a collective (gradient all-reduce, group rendezvous) before it gives the step up.")
    group_wait_s: float = opt(600.0, "Longest a rank of a data-parallel group waits for a membership that lets it train (enough ranks to start, or min_ranks after losses); past it the rank exits with an error instead of waiting for peers lost for good.")
    min_ranks: int = opt(1, "Fewest ranks a data-parallel group trains with once it started; below it the survivors wait (at most group_wait_s) for ranks to join.")
    max_ranks: int = opt(0, "Most ranks a data-parallel group takes (drafters attached beyond it wait for room); 0 = no bound. With count=1, max_ranks > 1 makes the one drafter a group that others can attach to.")
    rendezvous: str = opt("auto", "Where the ranks of a data-parallel group meet for each membership version: file (a FileStore in run.dir/groups, a directory every rank must see), tcp (a TCPStore each rank hosts, the version's rank 0's is used: ranks on nodes that share no directory); auto = tcp with pool.transport=nixl, else file.")
    rendezvous_host: str = opt("", "With drafter.rendezvous=tcp: the address this rank's store binds and advertises (gloo's interface too, unless GLOO_SOCKET_IFNAME is set); empty = this host's address on the route to dispatcher.endpoint (127.0.0.1 for ipc://).")
    elastic_batch: str = opt("tokens", "A step's size when the world size changes: tokens = accum_steps x count micro-batches a step, shared among the ranks (each takes at least one); ranks = accum_steps per rank, the step grows with the group.")
    step_balance: str = opt("cost", "How a group step's micro-batches are shared among its ranks: cost = each rank takes micro-batches until it holds its share of the step's estimated cost (the dispatcher fits a cost per job from the ranks' measured compute times), so no rank waits long for a slower one at the all-reduce; count = each rank takes the same number.")

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


def step_jobs(accum_steps: int, count: int, world_size: int, elastic_batch: str) -> int:
    """Micro-batches of one step of a ``world_size``-rank group: ``accum_steps x count`` shared
    among the ranks (``tokens``; each rank takes at least one) or ``accum_steps`` per rank (``ranks``)."""
    if elastic_batch == "ranks":
        return accum_steps * world_size
    return max(accum_steps * max(1, count), world_size)


@dataclass
class TrainingRecipe:
    """The optimizer, schedule and precision keys every drafter section has (the trainer's recipe)."""
    lr: float = opt(6e-4, "Peak AdamW learning rate.")
    betas: list[float] = opt([0.9, 0.95], "AdamW betas.")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay.")
    warmup_ratio: float = opt(0.04, "Share of the total steps spent warming the learning rate up linearly.")
    min_lr_ratio: float = opt(0.0, "Floor of the cosine decay, as a fraction of lr.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this; 0 = no clipping.")
    total_steps: int = opt(0, "Length of the cosine schedule in steps of accum_steps x drafter.count jobs; the schedule advances by the jobs each step trained, so a changing world size does not shift it. 0 = every job of every epoch.")
    loss_chunk_size: int = opt(4096, "Positions whose logits are computed at once (bounds the logits' memory).")
    dtype: str = opt("auto", "Compute dtype: auto (bfloat16 autocast on GPU, float32 on CPU), bfloat16 or float32.")
    export_dtype: str = opt("auto", "Dtype of the exported drafter weights; auto = the compute dtype.")
    log_every: int = opt(1, "Optimizer steps between two metric log lines.")


@dataclass
class DFlashSection(TrainingRecipe):
    block_size: int = opt(16, "Tokens per draft block: the anchor plus block_size - 1 drafted positions.")
    num_draft_layers: int = opt(5, "Draft decoder layers.")
    num_anchors: int = opt(512, "Most anchors (blocks) sampled per training sequence, re-drawn every time.")
    gamma: float = opt(0.0, "Loss decay: block position k weighs exp(-(k-1)/gamma); 0 = 7 for block 16, 5 for 10, 4 for 8.")
    mask_token_id: int = opt(-1, "Token id of the masked block positions; -1 = the tokenizer's mask token, else a reserved special token absent from the data, else an error.")
    attention: str = opt("auto", "Attention kernel: auto (flex attention on GPU, SDPA elsewhere), flex or sdpa.")


@dataclass
class Eagle3Section(TrainingRecipe):
    ttt_steps: int = opt(7, "Training-time test: steps unrolled on the drafter's own hidden states (and tokens drafted at evaluation).")
    draft_vocab: int = opt(32000, "Draft vocabulary: the most frequent target tokens of the training responses (capped at the target's vocabulary).")
    loss_decay: float = opt(0.8, "Step k of the training-time test weighs loss_decay ** k.")
    lr: float = opt(1e-4, "Peak AdamW learning rate.")
    warmup_ratio: float = opt(0.015, "Share of the total steps spent warming the learning rate up linearly.")
    grad_clip: float = opt(0.5, "Clip the global gradient norm to this; 0 = no clipping.")


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
    dflash: DFlashSection = field(default_factory=DFlashSection)
    eagle3: Eagle3Section = field(default_factory=Eagle3Section)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

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


RESOLVED_CONFIG_NAME = "config.yaml"
_CHOICES = {
    ("schedule", "order"): ("interleave", "shuffle"),
    ("schedule", "batching"): ("sorted", "fixed"),
    ("schedule", "assignment"): ("shared", "per_target"),
    ("pool", "pull"): ("deficit", "random"),
    ("pool", "transport"): ("auto", "shm", "cuda_ipc", "nixl"),
    ("nodes", "locality"): ("prefer", "any"),
    ("target", "dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("dflash", "dtype"): ("auto", "bfloat16", "float32"),
    ("dflash", "attention"): ("auto", "flex", "sdpa"),
    ("dflash", "export_dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("drafter", "backend"): ("dflash", "linear"),
    ("drafter", "objective"): ("dflash", "eagle3"),
    ("drafter", "rendezvous"): ("auto", "file", "tcp"),
    ("eagle3", "dtype"): ("auto", "bfloat16", "float32"),
    ("eagle3", "export_dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("target", "attn_implementation"): ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"),
}
_PATH_KEYS = (("run", "dir"), ("data", "lengths"), ("data", "path"), ("target", "model"))


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", item, item_type) for i, item in enumerate(value)]
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 4e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {annotation!r} for {key}")


def _check_section(section: str) -> None:
    known = [f.name for f in dataclasses.fields(Config)]
    if section not in known:
        raise ConfigError(f"unknown config section {section!r} (known: {', '.join(known)})")


def _apply(config: Config, section: str, key: str, value: Any) -> None:
    _check_section(section)
    section_obj = getattr(config, section)
    hints = typing.get_type_hints(type(section_obj))
    if key not in hints:
        raise ConfigError(f"unknown config key {section}.{key} (known: {', '.join(hints)})")
    setattr(section_obj, key, _coerce(f"{section}.{key}", value, hints[key]))


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is read as YAML (``[1, 2]``, ``true``),
    except for string keys, which keep the text as given (a secret ``0123`` stays ``0123``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    dotted, raw = text.split("=", 1)
    if dotted.count(".") != 1:
        raise ConfigError(f"override {text!r}: the key must be section.key")
    section, key = dotted.split(".")
    section_types = typing.get_type_hints(Config)
    if section in section_types and typing.get_type_hints(section_types[section]).get(key) is str:
        return section, key, raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {dotted}: cannot parse value {raw!r}: {exc}") from None
    return section, key, value


def validate(config: Config) -> None:
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(config, section), key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key}: {value!r} is not one of {', '.join(allowed)}")
    buckets = config.schedule.buckets
    if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ConfigError(f"schedule.buckets: expected positive lengths in strictly ascending order, got {buckets}")
    if config.schedule.tokens_per_batch < buckets[-1]:
        raise ConfigError(
            f"schedule.tokens_per_batch ({config.schedule.tokens_per_batch}) must hold at least one sequence "
            f"of the longest bucket ({buckets[-1]})")
    positive = [("run", "epochs"), ("pool", "slots"), ("pool", "target_credits"), ("drafter", "accum_steps"),
                ("drafter", "checkpoint_every"), ("drafter", "checkpoint_keep"), ("target", "hidden_size"),
                ("target", "num_capture_layers"), ("dispatcher", "max_message_bytes"), ("dflash", "block_size"),
                ("dflash", "num_draft_layers"), ("dflash", "num_anchors"), ("dflash", "lr"), ("dflash", "log_every"),
                ("eagle3", "ttt_steps"), ("eagle3", "draft_vocab"), ("eagle3", "loss_decay"), ("eagle3", "lr"),
                ("eagle3", "log_every"), ("eagle3", "loss_chunk_size")]
    for section, key in positive:
        if getattr(getattr(config, section), key) <= 0:
            raise ConfigError(f"{section}.{key} must be positive")
    for section, key in (("target", "count"), ("drafter", "count"), ("pool", "min_ready"), ("dflash", "total_steps"),
                         ("eagle3", "total_steps")):
        if getattr(getattr(config, section), key) < 0:
            raise ConfigError(f"{section}.{key} must not be negative")
    for section, key in (("target", "sim_cost_per_token"), ("target", "sim_cost_attention"),
                         ("drafter", "sim_cost_per_token"), ("drafter", "sim_cost_per_sequence")):
        if getattr(getattr(config, section), key) < 0:
            raise ConfigError(f"{section}.{key} must not be negative")
    if config.schedule.assignment == "per_target" and config.target.count < 1:
        raise ConfigError("schedule.assignment=per_target needs target.count >= 1 (one queue per target)")
    if config.nodes.remote_after_s < 0:
        raise ConfigError("nodes.remote_after_s must not be negative")
    if config.pool.min_ready >= config.pool.slots:
        raise ConfigError(f"pool.min_ready ({config.pool.min_ready}) must be below pool.slots ({config.pool.slots})")
    if not 0 <= config.dispatcher.metrics_port < 65536:
        raise ConfigError(f"dispatcher.metrics_port: {config.dispatcher.metrics_port} is not a port number")
    for key in ("heartbeat_s", "worker_timeout_s", "lease_s"):
        if getattr(config.dispatcher, key) <= 0:
            raise ConfigError(f"dispatcher.{key} must be positive")
    for key in ("collective_timeout_s", "group_wait_s"):
        if getattr(config.drafter, key) <= 0:
            raise ConfigError(f"drafter.{key} must be positive")
    drafter = config.drafter
    if drafter.min_ranks < 1:
        raise ConfigError("drafter.min_ranks must be at least 1")
    if drafter.max_ranks < 0:
        raise ConfigError("drafter.max_ranks must not be negative (0 = no bound)")
    if drafter.min_ranks > max(1, drafter.count):
        raise ConfigError(f"drafter.min_ranks ({drafter.min_ranks}) must not exceed drafter.count ({drafter.count}): "
                          f"a new group starts with count ranks")
    if drafter.max_ranks and drafter.max_ranks < drafter.count:
        raise ConfigError(f"drafter.max_ranks ({drafter.max_ranks}) must be 0 (no bound) or at least drafter.count "
                          f"({drafter.count})")
    host = drafter.rendezvous_host
    if host and (any(c.isspace() or c in "/[]" for c in host) or host.count(":") == 1):
        raise ConfigError(f"drafter.rendezvous_host: expected a host name or IP address (no port), got {host!r}")
    if drafter.elastic_batch not in ("tokens", "ranks"):
        raise ConfigError(f"drafter.elastic_batch must be tokens or ranks, not {drafter.elastic_batch!r}")
    if drafter.step_balance not in ("cost", "count"):
        raise ConfigError(f"drafter.step_balance must be cost or count, not {drafter.step_balance!r}")
    if config.drafter.model:
        try:
            check_model_id(config.drafter.model)
        except ValueError as exc:
            raise ConfigError(f"drafter.model: {exc}") from None
    if config.dispatcher.worker_timeout_s <= config.dispatcher.heartbeat_s:
        raise ConfigError("dispatcher.worker_timeout_s must exceed dispatcher.heartbeat_s")
    for role in ("target", "drafter"):
        section = getattr(config, role)
        if section.gpus and len(section.gpus) < section.count:
            raise ConfigError(f"{role}.gpus lists {len(section.gpus)} GPUs for {role}.count={section.count}")
    if config.data.lengths and config.data.path:
        raise ConfigError("data.lengths and data.path are exclusive: give one")
    for section, key in _PATH_KEYS[1:]:
        value = getattr(getattr(config, section), key)
        if value and not Path(value).exists():
            hint = " (a local model directory: nothing is downloaded)" if (section, key) == ("target", "model") else ""
            raise ConfigError(f"{section}.{key}: {value} does not exist{hint}")
    _validate_capture(config)


def _validate_capture(config: Config) -> None:
    layers = config.target.capture_layers
    if layers and (layers[0] < 0 or list(layers) != sorted(set(layers))):
        raise ConfigError(f"target.capture_layers: expected distinct layer ids >= 0 in ascending order, got {layers}")
    if not config.target.model:
        return
    try:
        doc = read_model_config(config.target.model)
    except ValueError as exc:
        raise ConfigError(f"target.model: {exc}") from None
    eagle3 = config.drafter.objective == "eagle3"
    try:
        contract = contract_from_config(config, model_config=doc)
    except ValueError as exc:
        key = "capture_layers" if layers or eagle3 else "num_capture_layers"
        raise ConfigError(f"target.{key}: {exc}") from None
    if eagle3 and contract.num_capture_layers != 3:
        # Serving engines build EAGLE-3's fc as 3 x hidden -> hidden: another count would not load.
        raise ConfigError(f"target.capture_layers: an EAGLE-3 drafter fuses exactly 3 target layers, "
                          f"got {list(contract.layer_ids)}")
    reason = unservable_reason(contract.layer_ids, num_layers=contract.num_layers, objective=config.drafter.objective)
    if reason and not config.target.allow_unservable:
        raise ConfigError(f"target.capture_layers {list(contract.layer_ids)}: {reason}")


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config file (optional), apply overrides, make paths absolute, validate."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections")
        for section, values in doc.items():
            if values is None:
                continue
            _check_section(str(section))
            if not isinstance(values, dict):
                raise ConfigError(f"config section {section!r} must be a mapping of keys")
            for key, value in values.items():
                _apply(config, str(section), str(key), value)
    for text in overrides:
        _apply(config, *parse_override(text))
    for section, key in _PATH_KEYS:
        value = getattr(getattr(config, section), key)
        if value:
            setattr(getattr(config, section), key, str(Path(value).expanduser().resolve()))
    validate(config)
    return config


RESOLVED_HEADER = ("# The run's resolved config. nodes.name is left empty: each node names its own (hsd target/drafter\n"
                   "# --node, nodes.name=..., or by default its hostname), never the node that wrote this file.\n")


def write_resolved(config: Config, run_dir: Path | None = None) -> Path:
    run_dir = Path(run_dir or config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_CONFIG_NAME
    doc = config.to_dict()
    doc["nodes"]["name"] = ""  # node-local: a worker started from this file on another node is not this one
    return atomic_write(target, RESOLVED_HEADER + yaml.safe_dump(doc, sort_keys=False),
                        tmp_name=target.with_suffix(".tmp").name)


def load_run_config(run_dir: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Config:
    """The resolved config of an existing run directory."""
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no {RESOLVED_CONFIG_NAME})")
    return load_config(path, overrides)


def describe() -> str:
    """Every section and key with its type, default and help line."""
    lines = []
    for section_field in dataclasses.fields(Config):
        section_type = typing.get_type_hints(Config)[section_field.name]
        lines.append(f"{section_field.name}:")
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            type_name = getattr(hints[f.name], "__name__", str(hints[f.name]))
            lines.append(f"  {f.name}: {default!r}  # ({type_name}) {f.metadata.get('help', '')}")
    return "\n".join(lines)
