"""The arithmetic of ``hsd bench scale`` (:mod:`benchmarks.scale`), apart from its processes: the GPU
model the simulated workers follow, how a sweep step's workers split into targets and drafters,
and the figures of a step from what was sampled at the start and the end of its window."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

REQUEST_P99_TARGET_MS = 10.0  # a step whose request p99 is above this serves its GPUs too late to count
DRAFTER_HEADROOM = 1.25  # drafters train this much more than the targets produce
CLIENT_SATURATED_PCT = 90.0  # a client process busier than this (of one core) may be the bottleneck


@dataclass(frozen=True)
class GpuModel:
    """What one simulated worker stands for: a target GPU that captures ``tokens_per_s`` prefill
    tokens a second, jobs of ``job_tokens`` tokens (a slot's token budget), and a drafter GPU that
    trains ``drafter_batches_per_s`` micro-batches (one job each) a second."""

    tokens_per_s: float = 27_000.0
    job_tokens: int = 16_384
    drafter_batches_per_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "job_tokens", "drafter_batches_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def job_s(self) -> float:
        """Seconds a target GPU spends on one job."""
        return self.job_tokens / self.tokens_per_s

    @property
    def target_jobs_per_s(self) -> float:
        """Items one target GPU produces a second: the load one GPU puts on the dispatcher."""
        return self.tokens_per_s / self.job_tokens

    def scaled(self, load: float) -> "GpuModel":
        """The model whose GPUs work ``load`` times as fast: one simulated worker of it sends the
        requests of ``load`` workers of this one (``hsd bench scale --load``)."""
        return GpuModel(tokens_per_s=self.tokens_per_s * load, job_tokens=self.job_tokens,
                        drafter_batches_per_s=self.drafter_batches_per_s * load)

    def split(self, workers: int, drafter_fraction: float = 1.0) -> tuple[int, int]:
        """``workers`` as (targets, drafters): as few drafters as consume what the targets produce with
        ``DRAFTER_HEADROOM`` to spare (rounded up), at least one of each. Drafters with exactly the
        targets' rate would be a queue at full load: ready slots would pile up until the pool is full
        and every get_job waited for a slot, whatever the dispatcher's own speed. ``drafter_fraction``
        scales that many drafters (the rest are targets): below 1 the drafters are the bottleneck, the
        pool fills and the targets wait for free slots, as in a run whose drafters train slower than
        its targets capture."""
        if workers < 2:
            raise ValueError(f"a sweep step needs at least 2 workers (a target and a drafter), got {workers}")
        produced = self.target_jobs_per_s * DRAFTER_HEADROOM
        share = produced / (produced + self.drafter_batches_per_s)
        drafters = min(workers - 1, max(1, math.ceil(workers * share)))
        if drafter_fraction != 1.0:
            drafters = min(workers - 1, max(1, round(drafters * drafter_fraction)))
        return workers - drafters, drafters

    def gpus_per_core(self, cpu_s_per_item: float) -> float:
        """Target GPUs one dispatcher core serves at this model: 1 core ÷ CPU per item ÷ items per GPU."""
        if not cpu_s_per_item > 0:
            return math.inf
        return 1.0 / cpu_s_per_item / self.target_jobs_per_s


def parse_workers(text: str) -> list[int]:
    """``--workers 16,64,256``: the sweep's steps, each at least 2, ascending as given."""
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--workers must be comma-separated integers, got {text!r}") from None
    if not steps or min(steps) < 2:
        raise ValueError(f"--workers needs steps of at least 2 workers each, got {text!r}")
    return steps


def gpus_served_in_time(steps: list[dict[str, Any]]) -> float | None:
    """The most GPUs' traffic one step served with request p99 within REQUEST_P99_TARGET_MS, exactly
    once (None: no step did): what one dispatcher serves on this host, measured rather than projected."""
    served = [s["gpus_served"] for s in steps if s["items"] and not s["duplicates"]
              and s["request_p99_ms"] <= REQUEST_P99_TARGET_MS]
    return max(served) if served else None


def parse_loads(text: str) -> list[float]:
    """``--load 1,2,4``: multiples of the GPU model's rates each step runs at, each positive."""
    try:
        loads = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--load must be comma-separated numbers, got {text!r}") from None
    if not loads or not all(math.isfinite(load) and load > 0 for load in loads):
        raise ValueError(f"--load needs positive multiples, got {text!r}")
    return loads


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 100] (the transport bench's)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latency_figures(samples_ms: list[float]) -> dict[str, float | int]:
    if not samples_ms:
        return {"n": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    return {"n": len(samples_ms), "p50_ms": percentile(samples_ms, 50), "p99_ms": percentile(samples_ms, 99),
            "max_ms": max(samples_ms)}


# ops the clients time as "requests": answered at once by a dispatcher that keeps up (get_hs is
# left out: a drafter with time to spare waits in it for a ready slot by design)
REQUEST_OPS = ("get_job", "job_ready", "heartbeat", "commit_step")


def step_figures(*, model: GpuModel, load: float = 1.0, targets: int, drafters: int, window_s: float,
                 dispatcher_cpu_s: float,
                 loop_thread_cpu_s: float, items: int, requests: dict[str, int], given_back: dict[str, int],
                 journal_bytes: int, latencies_ms: dict[str, list[float]], heartbeat_lag_ms: list[float],
                 heartbeat_age_max_s: float, client_cpu_s: list[float], host: dict[str, float],
                 committed: int, duplicates: int, errors: dict[str, int], late_wakeups: int) -> dict[str, Any]:
    """One sweep step's figures. ``items``: jobs the targets reported ready over the window;
    ``requests``/``given_back``: the dispatcher's counters over the window; ``dispatcher_cpu_s``:
    its process's CPU (every thread), ``loop_thread_cpu_s`` its socket loop's alone;
    ``latencies_ms``: per op, requests the clients sent inside the window. ``model`` is the stated
    GPU model; the workers ran at ``load`` times its rates, and GPUs are counted in its GPUs."""
    cpu_per_item = dispatcher_cpu_s / items if items else math.nan
    loop_per_item = loop_thread_cpu_s / items if items else math.nan
    timed = [ms for op in REQUEST_OPS for ms in latencies_ms.get(op, [])]
    request = latency_figures(timed)
    client_pct = [100.0 * s / window_s for s in client_cpu_s]
    return {
        "workers": targets + drafters, "targets": targets, "drafters": drafters, "load": load,
        "window_s": window_s, "offered_items_per_s": targets * model.target_jobs_per_s * load,
        "items": items, "items_per_s": items / window_s,
        "gpus_served": items / window_s / model.target_jobs_per_s,
        "dispatcher_cpu_pct": 100.0 * dispatcher_cpu_s / window_s,
        "dispatcher_cpu_us_per_item": 1e6 * cpu_per_item,
        "loop_thread_cpu_us_per_item": 1e6 * loop_per_item,
        "projected_gpus_per_core": model.gpus_per_core(cpu_per_item) if items else math.nan,
        "messages_per_item": {op: n / items for op, n in requests.items()} if items else {},
        "requests": requests,
        "request_p50_ms": request["p50_ms"], "request_p99_ms": request["p99_ms"],
        "request_max_ms": request["max_ms"], "requests_timed": request["n"],
        "latency_by_op": {op: latency_figures(ms) for op, ms in sorted(latencies_ms.items())},
        "heartbeat_lag_p99_ms": latency_figures(heartbeat_lag_ms)["p99_ms"],
        "heartbeat_lag_max_ms": latency_figures(heartbeat_lag_ms)["max_ms"],
        "heartbeat_age_max_s": heartbeat_age_max_s,
        "journal_bytes_per_s": journal_bytes / window_s,
        "journal_bytes_per_item": journal_bytes / items if items else math.nan,
        "client_cpu_pct": client_pct,
        "client_saturated": any(pct > CLIENT_SATURATED_PCT for pct in client_pct),
        "given_back": given_back, "errors": errors,
        "committed": committed, "duplicates": duplicates, "late_wakeups": late_wakeups,
        **host,
    }
