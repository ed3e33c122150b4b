"""``hsd stats``: ask a running dispatcher's read-only stats socket and print the answer.

Besides the snapshot itself, the view derives three things a user watching a run asks first:
how full the pool is in bytes, when the epoch (and the run) will end, and which stage holds the
other back. The derivations are pure functions of snapshots, so they are tested without a run.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from common.wire import messages
from common.wire.stats_snapshot import Snapshot, WaitingFor, WorkerView, to_json_object
from common.wire.client import DispatcherClient, DispatcherUnavailable
from common.run.config import ConfigError, load_config, load_run_config
from common.wire.curve import CurveClient, client_from_config, client_from_keys, handshake_refused
from common.wire.stats_figures import counter_delta, format_nodes, format_q_hsb, pool_usage
from ops.report import dropped_line

DEFAULT_RUN_DIR = "runs/demo"
DEFAULT_ROWS = 64  # worker rows the table shows; past that, a summary a role and the workers that most need a look
SILENT_S = 5.0  # a heartbeat age from which a worker is shown first (ten heartbeats at the default 0.5 s)
NAMES_SHOWN = 12  # names on the "waiting ... on" line


def resolve_stats_endpoint(endpoint: str | None, run_dir: str | None, *, config_path: str | None = None,
                           overrides: list[str] | None = None, keys_dir: str | None = None, client: str | None = None,
                           secret: str = "") -> tuple[str, str, CurveClient | None]:
    """(endpoint, secret, CURVE keys) from --endpoint (with --keys/--client and --secret), from a
    config file (another node's copy of the run's config, with that node's own key pair as an
    override), or from the run directory's resolved config."""
    if endpoint:
        return endpoint, secret, client_from_keys(keys_dir, client) if keys_dir else None
    if keys_dir or client or secret:
        raise ConfigError("hsd stats: --keys, --client and --secret go with --endpoint (a config names its own)")
    if config_path:
        config = load_config(config_path, overrides or [])
        return config.stats_endpoint, config.dispatcher.secret, client_from_config(config.curve)
    run_dir = run_dir or DEFAULT_RUN_DIR
    if not Path(run_dir).is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist (give --run-dir or --endpoint)")
    config = load_run_config(run_dir)
    return config.stats_endpoint, config.dispatcher.secret, client_from_config(config.curve)


STATS_TIMEOUT_S = 10.0  # hsd stats: how long a dispatcher may take to answer before it is said not to


def fetch_stats(endpoint: str, secret: str = "", timeout_s: float = 3.0, *,
                curve: CurveClient | None = None) -> Snapshot:
    client = DispatcherClient(endpoint, secret=secret, timeout_s=timeout_s, curve=curve)
    try:
        return client.call(messages.Stats()).stats
    finally:
        client.close()


def run_stats_or_none(run_dir: str | Path, *, timeout_s: float = 1.0) -> Snapshot | None:
    """The snapshot of ``run_dir``'s dispatcher, or None while none answers (not started yet,
    restarting): for whoever watches a run from outside it (tests, ``hsd bench gpu``)."""
    if not (Path(run_dir) / "config.yaml").exists():
        return None
    try:
        endpoint, secret, curve = resolve_stats_endpoint(None, str(run_dir))
        return fetch_stats(endpoint, secret, timeout_s=timeout_s, curve=curve)
    except DispatcherUnavailable:
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


# -- epoch and run ETA ---------------------------------------------------------------------------
RATE_WINDOW_S = 30.0  # long enough to smooth over optimizer-step bursts, short enough to follow a change


def committed_jobs(s: Snapshot) -> int:
    return sum(e.committed for e in s.epochs)


def remaining_jobs(s: Snapshot) -> tuple[int, int]:
    """(jobs left in the current epoch, jobs left in the run); epochs not yet started count as large
    as the last started one (epochs of one dataset differ by a few batches at most)."""
    epochs = s.epochs
    if not epochs:
        return 0, 0
    open_epochs = [e for e in epochs if e.committed < e.jobs]
    epoch_left = open_epochs[0].jobs - open_epochs[0].committed if open_epochs else 0
    unstarted = max(0, s.epochs_total - len(epochs))
    run_left = sum(e.jobs - e.committed for e in epochs) + unstarted * epochs[-1].jobs
    return epoch_left, run_left


class CommitRate:
    """Committed jobs per second over the last ``RATE_WINDOW_S`` of snapshots."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._pid: int | None = None

    def add(self, s: Snapshot) -> None:
        if s.pid != self._pid:  # another dispatcher: its counts start over
            self._samples.clear()
            self._pid = s.pid
        self._samples.append((s.time, committed_jobs(s)))
        while len(self._samples) > 2 and self._samples[-1][0] - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()

    def rate(self, s: Snapshot) -> float:
        if len(self._samples) >= 2 and self._samples[-1][0] > self._samples[0][0]:
            (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
            return max(0.0, (c1 - c0) / (t1 - t0))
        # a single snapshot: the average since the dispatcher started
        return committed_jobs(s) / s.uptime_s if s.uptime_s else 0.0


def eta_line(s: Snapshot, rate: float) -> str:
    if s.done:
        return "eta       run complete"
    epoch_left, run_left = remaining_jobs(s)
    if rate <= 0:
        return f"eta       unknown (no job committed yet); {epoch_left} job(s) left in this epoch, {run_left} in the run"
    return (f"eta       epoch in {_duration(epoch_left / rate)}, run in {_duration(run_left / rate)} "
            f"({rate:,.1f} jobs/s committed; {epoch_left} left in this epoch, {run_left} in the run)")


# -- bottleneck ------------------------------------------------------------------------------------
# A stage that waits less than this share of its time counts as busy. Below it, waits are the
# handoff gaps of a pipeline that runs at the slower stage's speed, not a missing resource.
WAIT_THRESHOLD = 0.15


def baseline(s: Snapshot, previous: Snapshot | None) -> Snapshot | None:
    """``previous`` when it is the same dispatcher's (the figures since it are recent ones), else None:
    a restarted dispatcher counts from zero."""
    return previous if previous is not None and previous.pid == s.pid else None


def stage_waits(s: Snapshot, previous: Snapshot | None = None) -> dict[str, float | None]:
    """Share of time each stage's workers waited: since the previous snapshot when there is one
    (workers present in both), else since each worker registered. None for a stage with no worker."""
    base = baseline(s, previous)
    old = {w.id: w for w in base.workers} if base is not None else {}
    waits: dict[str, float | None] = {}
    for role in ("target", "drafter"):
        workers = [w for w in s.workers if w.role == role]
        if not workers:
            waits[role] = None
            continue
        alive = wait = 0.0
        for w in workers:
            before = old.get(w.id)
            if before is not None and w.alive_s > before.alive_s:
                alive += w.alive_s - before.alive_s
                wait += w.wait_s - before.wait_s
            else:
                alive += w.alive_s
                wait += w.wait_s
        waits[role] = min(1.0, max(0.0, wait / alive)) if alive > 0 else 0.0
    return waits


def nothing_to_extract(s: Snapshot) -> bool:
    """The last epoch has started and no job of it is pending: targets may idle, that is the tail."""
    return len(s.epochs) >= s.epochs_total and s.jobs_by_state.get("pending", 0) == 0


def name_bottleneck(*, target_wait: float | None, drafter_wait: float | None, tail: bool = False,
                    done: bool = False) -> str:
    """One line: which stage idles, which starves, and what to change.

    ``target_wait``/``drafter_wait`` are the shares of time each stage waited (None: no worker of
    that stage). A target waits either blocked (no free slot it may take) or with nothing left to
    extract; ``tail`` says the second case holds, so target waits are then not a drafter shortage.
    """
    if done:
        return "run complete"
    if target_wait is None or drafter_wait is None:
        missing = [role for role, w in (("target", target_wait), ("drafter", drafter_wait)) if w is None]
        return f"no {' and no '.join(missing)} registered — nothing moves until one attaches"
    t_pct, d_pct = f"{target_wait:.0%}", f"{drafter_wait:.0%}"
    if tail:
        return (f"epoch tail: nothing left to extract — targets idle {t_pct}, drafters wait {d_pct} "
                f"while the last jobs drain")
    targets_wait, drafters_wait = target_wait >= WAIT_THRESHOLD, drafter_wait >= WAIT_THRESHOLD
    if targets_wait and drafters_wait:
        return (f"targets blocked {t_pct} while drafters wait for data {d_pct} — the pool holds both back: "
                f"raise pool.slots or pool.target_credits, or lower pool.min_ready")
    if drafters_wait:
        return (f"drafters wait for data {d_pct} — targets are the bottleneck: "
                f"add targets or raise pool.target_credits")
    if targets_wait:
        return f"targets blocked on a full pool {t_pct} — drafters are the bottleneck: add drafters"
    return f"balanced: targets wait {t_pct}, drafters wait {d_pct}"


def bottleneck_line(s: Snapshot, previous: Snapshot | None = None) -> str:
    waits = stage_waits(s, previous)
    return "bottleneck " + name_bottleneck(target_wait=waits["target"], drafter_wait=waits["drafter"],
                                           tail=nothing_to_extract(s), done=s.done)


LOOP_BUSY = 0.8  # the dispatcher's loop at this share of a core or more: requests start to queue behind each other
LOOP_TOP = 5  # ops and phases named on the dispatcher line


def dispatcher_line(s: Snapshot, previous: Snapshot | None = None) -> str | None:
    """How much of a core the dispatcher's socket loop takes, how often it wakes and for how many
    requests a wake-up, and on what (its ``loop_cpu_s``): over
    the interval since ``previous`` when it is the same dispatcher's, else since it started. None
    when the snapshot carries no such figures (an older dispatcher)."""
    base = baseline(s, previous)
    wall = s.uptime_s - (base.uptime_s if base is not None else 0.0)
    spent = {what: seconds for what, seconds in
             counter_delta(base.loop_cpu_s if base is not None else {}, s.loop_cpu_s).items() if seconds > 0}
    if not spent or wall <= 0:
        return None
    busy = sum(spent.values()) / wall
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:LOOP_TOP]
    line = f"dispatcher loop {busy:.0%} of a core"
    wakeups = s.loop_wakeups - (base.loop_wakeups if base is not None else 0)
    if wakeups > 0:  # a message that wakes the loop alone costs it most (docs/benchmarks.md)
        requests = sum(counter_delta(base.requests if base is not None else {}, s.requests).values())
        line += f", {wakeups / wall:,.0f} wake-ups/s ({requests / wakeups:.1f} requests each)"
    line += ": " + ", ".join(f"{what} {seconds / wall:.0%}" for what, seconds in top)
    if busy >= LOOP_BUSY:
        line += " — near one core: requests queue behind each other (docs/benchmarks.md, hsd bench scale --load)"
    return line


def format_stats(s: Snapshot, *, previous: Snapshot | None = None, rate: float | None = None,
                 rows: int = DEFAULT_ROWS) -> str:
    """The table ``hsd stats`` prints; ``previous`` (the last snapshot shown) and ``rate`` (committed
    jobs/s) make the idle shares and the ETA recent rather than averages since the start. ``rows``
    bounds the worker table (0: every worker; see :func:`worker_rows`)."""
    t = s.transport
    lines = [f"run {s.run_dir}  (run id {s.run_id}, dispatcher pid {s.pid}, up {s.uptime_s:.0f}s)"
             + ("  DONE" if s.done else "")]
    for e in s.epochs:
        pct = e.committed / max(1, e.jobs)
        lines.append(f"epoch {e.epoch + 1}/{s.epochs_total}: {e.committed}/{e.jobs} committed ({pct:.0%}), "
                     f"{e.taken} taken; prefix deviation schedule {e.schedule_prefix_deviation:.2f} "
                     f"consumed {e.consumed_prefix_deviation:.2f}")
    lines.append(eta_line(s, rate if rate is not None else CommitRate().rate(s)))
    lines.append("jobs      " + "  ".join(f"{k} {v}" for k, v in s.jobs_by_state.items()))
    if s.dropped_samples is not None:
        lines.append(dropped_line(s.dropped_samples.count, s.dropped_samples.first, s.dropped_samples.longer_than))
    lines.append("q_hsb     " + format_q_hsb(s.q_hsb))
    lines.append(f"pool      {t.kind}, {t.num_slots} slots{' per target' if t.per_target else ''} x "
                 f"{_mib(t.slot_bytes)} = {_mib(t.pool_bytes)}; "
                 + "  ".join(f"{k} {v}" for k, v in s.pool.items()))
    usage = pool_usage(s)
    if usage is not None:
        lines.append(f"pool use  {_mib(usage[0])} of {_mib(usage[1])} ({usage[0] / max(1, usage[1]):.0%})")
    lines.extend(format_nodes(s.nodes, t.slot_bytes))
    mix = f" (mixed {s.step_mix:.0%} since the dispatcher started)" if s.step_mix is not None else ""
    lines.append(f"steps     {s.steps}{mix}   given back {s.given_back or 0}   errors {s.errors or 0}")
    for model, g in s.groups.items():
        ranks = " ".join(f"{r}:{w}" for r, w in sorted(g.members.items(), key=lambda m: int(m[0])))
        lines.append(f"group     {model}: {g.world_size} rank(s) [{ranks}]  membership {g.version}  "
                     f"{g.waiting} waiting  {g.steps_since_change} steps since change  "
                     f"{g.step_jobs} jobs/step balanced by {g.step_balance}")
        cost = g.step_cost
        if cost is not None:
            lines.append(f"          step cost model: {cost.jobs * 1e3:.2f} ms/job + {cost.sequences * 1e3:.3f} ms/"
                         f"sequence + {cost.padded_tokens * 1e6:.2f} us/padded token "
                         f"({cost.observations} observations)")
    auth = s.auth
    if auth.mechanism == "curve":
        lines.append(f"auth      curve: {auth.accepted} accepted, {auth.refused} keys refused, "
                     f"{auth.handshakes_failed} handshakes failed")
    lines.append(bottleneck_line(s, previous))
    loop = dispatcher_line(s, previous)
    if loop is not None:
        lines.append(loop)
    lines.extend(waiting_lines(s.waiting_for))
    lines.append("")
    shown = worker_rows(s.workers, rows)
    if len(shown) < len(s.workers):
        lines += role_summary_lines(s.workers)
        lines.append(f"the {len(shown)} workers that most need a look (silent {SILENT_S:g} s or more first, then the "
                     f"most idle); {len(s.workers) - len(shown):,} more not shown (--rows 0 shows every one)")
    lines.append(f"{'worker':<12} {'id':<5} {'role':<8} {'state':<8} {'jobs':>6} {'tok/s':>10} {'idle':>6} "
                 f"{'hb age':>7}  pid@host")
    for w in shown:
        lines.append(f"{w.name:<12} {w.id:<5} {w.role:<8} {w.state:<8} {w.jobs:>6} "
                     f"{w.tokens_per_s:>10,.0f} {w.idle_ratio:>6.1%} {w.heartbeat_age_s:>6.1f}s  "
                     f"{w.pid}@{w.host}")
        if w.tp_ranks:
            ranks = "  ".join(f"{r.rank}:pid {r.pid}" + (f" gpu {r.gpu}" if r.gpu is not None else "")
                              for r in w.tp_ranks)
            lines.append(f"{'':<12} {'':<5} tensor-parallel, {len(w.tp_ranks)} ranks: {ranks}")
    if not s.workers:
        lines.append("(no worker registered)")
    lines += step_metric_lines(shown)
    lines += gpu_health_lines(shown)
    return "\n".join(lines)


def worker_rows(workers: list[WorkerView], rows: int) -> list[WorkerView]:
    """The workers the table shows: every one by role and name when they fit in ``rows`` (or
    ``rows`` is 0); else the ``rows`` that most need a look, in that order: silent for ``SILENT_S``
    or more (longest first), then the most idle."""
    if not rows or len(workers) <= rows:
        return sorted(workers, key=lambda w: (w.role, w.name))
    ranked = sorted(workers, key=lambda w: (w.heartbeat_age_s < SILENT_S, -w.heartbeat_age_s
                                            if w.heartbeat_age_s >= SILENT_S else -w.idle_ratio, w.role, w.name))
    return ranked[:rows]


def role_summary_lines(workers: list[WorkerView]) -> list[str]:
    """A line a role: how many, by state, their tokens/s, mean idle share and the oldest heartbeat."""
    lines = []
    for role in sorted({w.role for w in workers}):
        group = [w for w in workers if w.role == role]
        states: dict[str, int] = {}
        for w in group:
            states[w.state] = states.get(w.state, 0) + 1
        by_state = "  ".join(f"{state} {n:,}" for state, n in sorted(states.items(), key=lambda kv: -kv[1]))
        lines.append(f"{role + 's':<12} {len(group):,}: {by_state}; {sum(w.tokens_per_s for w in group):,.0f} tok/s, "
                     f"idle {sum(w.idle_ratio for w in group) / len(group):.1%} mean, "
                     f"heartbeat age max {max(w.heartbeat_age_s for w in group):.1f}s")
    return lines


def waiting_lines(waiting: WaitingFor | None) -> list[str]:
    """What a run that is not done waits for (the snapshot's ``waiting_for``), a line a reason."""
    if waiting is None:
        return []
    lines = [f"waiting   {reason}" for reason in waiting.reasons]
    if waiting.workers:
        names, more = waiting.workers[:NAMES_SHOWN], len(waiting.workers) - NAMES_SHOWN
        lines.append(f"          on {', '.join(names)}" + (f" and {more:,} more" if more > 0 else ""))
    return lines


def step_metric_lines(workers: list[WorkerView]) -> list[str]:
    """The latest step figures each drafter sent with its commits (loss, accuracy, lr, ...)."""
    lines = []
    for w in sorted(workers, key=lambda w: w.name):
        if w.metrics:
            figures = "  ".join(f"{k} {v:.4g}" for k, v in w.metrics.items())
            lines.append(f"{w.name:<12} last step: {figures}")
    return lines


def gpu_health_lines(workers: list[WorkerView]) -> list[str]:
    """Each worker's slot copy times, and a GPU worker's memory and compiled graphs."""
    lines = []
    for w in sorted(workers, key=lambda w: w.name):
        h, c = w.gpu_health, w.slot_copies
        copies = (f"copy p50 {c.copy_ms_p50:.2f} ms p99 {c.copy_ms_p99:.2f} ms ({c.copies} slots)"
                  if c is not None else "no slot copied yet")
        if h is not None:
            lines.append(f"{w.name:<12} gpu: allocated {h.memory_allocated_bytes / 2**30:.2f} GiB  reserved "
                         f"{h.memory_reserved_bytes / 2**30:.2f} GiB  peak {h.memory_peak_bytes / 2**30:.2f} GiB  "
                         f"{copies}  {h.compiled_graphs} compiled graphs")
        elif c is not None:
            lines.append(f"{w.name:<12} slots: {copies}")
    return lines


def run_stats(*, endpoint: str | None, run_dir: str | None, as_json: bool, watch_s: float | None,
              config_path: str | None = None, overrides: list[str] | None = None, keys_dir: str | None = None,
              client: str | None = None, secret: str = "", rows: int = DEFAULT_ROWS) -> int:
    if rows < 0:
        raise ConfigError(f"hsd stats: --rows must be 0 (every worker) or more, got {rows}")
    endpoint, secret, curve = resolve_stats_endpoint(endpoint, run_dir, config_path=config_path, overrides=overrides,
                                                     keys_dir=keys_dir, client=client, secret=secret)
    commit_rate, previous = CommitRate(), None
    while True:
        # Over TCP the handshake is asked first (it answers at once, either way, from a listening
        # dispatcher): a refused one is said as such, not waited out as a dispatcher that is down.
        if endpoint.startswith("tcp://") and handshake_refused(endpoint, curve):
            print(f"CURVE handshake refused at {endpoint}: pass --config or the keys (--keys DIR [--client NAME])"
                  + (" of a key pair the dispatcher allows" if curve else ""))
            if not watch_s:
                return 1
            time.sleep(watch_s)
            continue
        try:
            # a loaded host's dispatcher may take seconds to answer, over CURVE too: wait that long
            stats = fetch_stats(endpoint, secret, timeout_s=STATS_TIMEOUT_S, curve=curve)
        except DispatcherUnavailable:
            print(f"no dispatcher answers at {endpoint}")
            if not watch_s:
                return 1
        else:
            if as_json:
                print(json.dumps(to_json_object(stats)), flush=True)
            else:
                commit_rate.add(stats)
                if watch_s:
                    print("\033[2J\033[H", end="")
                print(format_stats(stats, previous=previous, rate=commit_rate.rate(stats), rows=rows), flush=True)
                previous = stats
        if not watch_s:
            return 0
        time.sleep(watch_s)
