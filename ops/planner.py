"""``hsd plan``: how to split N GPUs between targets and drafters.

Each stage has a capacity per GPU: the tokens per second one worker moves while never waiting.
A pipeline of ``t`` targets and ``d`` drafters then trains at most
``min(t × target rate, d × drafter rate)`` tokens per second — every job passes through both
stages, so the slower stage sets the pace and the faster one idles the rest of its time.

The rates come either from a finished (or running) run's journal — target ``ready`` events and
drafter ``commit`` events carry the busy seconds and tokens of what the worker did — or, for a
sim run not made yet, from the configured cost model (one token costs ``sim_cost_per_token``
seconds). The arithmetic is pure; :func:`run_plan` is the command around it.

A target bigger than one GPU runs as a tensor-parallel group of ``target.tp_size`` GPUs; its rate
is then the group's (a measured run's target is its group). ``--target-params`` picks the smallest
``tp_size`` whose share of the bf16 weights, plus a reserve for activations, fits one GPU
(:func:`tp_size_for`), and every split counts a target as that many GPUs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.run.config import Config, ConfigError, load_config
from ops.report import read_run

STAGES = ("target", "drafter")


@dataclass(frozen=True)
class StageRates:
    """Tokens per second of one worker (one GPU) of each stage when it never waits."""
    target: float
    drafter: float
    source: str  # where the rates come from, said in the plan's header

    def __post_init__(self) -> None:
        for stage in STAGES:
            rate = getattr(self, stage)
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"the {stage} rate must be a positive number of tokens/s, got {rate!r}")


TP_SIZES = (1, 2, 4, 8)  # a target group lives on one node: at most 8 GPUs, split evenly
BYTES_PER_PARAM = 2  # bf16 weights
GB = 1e9


@dataclass(frozen=True)
class TargetMemory:
    """Why a target of ``params`` parameters takes ``tp_size`` GPUs of ``gpu_memory_gb``."""
    params: float
    tp_size: int
    weights_gb: float  # all of them, bf16
    per_gpu_gb: float  # one rank's share
    reserve_gb: float  # activations, KV of a job's length, captured states, CUDA context
    gpu_memory_gb: float


def tp_size_for(params: float, *, gpu_memory_gb: float, reserve_gb: float) -> TargetMemory:
    """The smallest tensor-parallel size whose share of the weights plus ``reserve_gb`` fits one GPU."""
    if not (math.isfinite(params) and params > 0):
        raise ValueError(f"--target-params {params!r}: a positive number of parameters (e.g. 70e9)")
    weights_gb = params * BYTES_PER_PARAM / GB
    for tp_size in TP_SIZES:
        if weights_gb / tp_size + reserve_gb <= gpu_memory_gb:
            return TargetMemory(params=params, tp_size=tp_size, weights_gb=weights_gb,
                                per_gpu_gb=weights_gb / tp_size, reserve_gb=reserve_gb, gpu_memory_gb=gpu_memory_gb)
    raise ValueError(f"--target-params {params:g}: {weights_gb:,.0f} GB of bf16 weights do not fit {TP_SIZES[-1]} GPUs "
                     f"of {gpu_memory_gb:g} GB with {reserve_gb:g} GB each for activations (one node's group at most)")


@dataclass(frozen=True)
class Split:
    targets: int  # target workers (tensor-parallel groups of tp_size GPUs each)
    drafters: int
    target_capacity: float  # tokens/s of all targets together
    drafter_capacity: float
    tokens_per_s: float  # what the pipeline trains: the slower stage's capacity
    bottleneck: str  # "target", "drafter" or "balanced"
    target_utilization: float  # share of the targets' time spent working
    drafter_utilization: float
    idle_share: float  # share of its time the faster stage waits (0 when balanced)
    gpu_efficiency: float  # share of all GPU time spent working
    tp_size: int = 1  # GPUs per target


def evaluate_split(rates: StageRates, targets: int, drafters: int, tp_size: int = 1) -> Split:
    target_capacity, drafter_capacity = targets * rates.target, drafters * rates.drafter
    expected = min(target_capacity, drafter_capacity)
    if math.isclose(target_capacity, drafter_capacity, rel_tol=1e-9):
        bottleneck = "balanced"
    else:
        bottleneck = "target" if target_capacity < drafter_capacity else "drafter"
    target_use, drafter_use = expected / target_capacity, expected / drafter_capacity
    return Split(targets=targets, drafters=drafters, target_capacity=target_capacity,
                 drafter_capacity=drafter_capacity, tokens_per_s=expected, bottleneck=bottleneck,
                 target_utilization=target_use, drafter_utilization=drafter_use,
                 idle_share=1.0 - min(target_use, drafter_use),
                 gpu_efficiency=((targets * tp_size * target_use + drafters * drafter_use)
                                 / (targets * tp_size + drafters)),
                 tp_size=tp_size)


def plan_splits(rates: StageRates, num_gpus: int, tp_size: int = 1) -> list[Split]:
    """Every split t × tp_size + d = num_gpus with at least one target and one drafter, fewest targets first."""
    if num_gpus < tp_size + 1:
        raise ValueError(f"--gpus {num_gpus}: a run needs at least {tp_size + 1} GPUs (one target of "
                         f"{tp_size} and one drafter)")
    return [evaluate_split(rates, t, num_gpus - t * tp_size, tp_size) for t in range(1, (num_gpus - 1) // tp_size + 1)]


def recommend(rates: StageRates, splits: list[Split]) -> Split:
    """The split that trains the most tokens/s; among equals, the one giving fewer GPUs to the
    faster stage (per GPU): its spare capacity is what idles, so the slower stage gets the GPU."""
    best = max(s.tokens_per_s for s in splits)
    ties = [s for s in splits if math.isclose(s.tokens_per_s, best, rel_tol=1e-9)]
    faster = "target" if rates.target >= rates.drafter else "drafter"
    return min(ties, key=lambda s: s.targets if faster == "target" else s.drafters)


# -- where the rates come from -------------------------------------------------------------------
def rates_from_config(config: Config, source: str = "the sim cost model") -> StageRates:
    costs = {stage: getattr(config, stage).sim_cost_per_token for stage in STAGES}
    for stage, cost in costs.items():
        if cost <= 0:
            raise ConfigError(f"{stage}.sim_cost_per_token must be positive to plan from the cost model, got {cost}")
    return StageRates(target=1.0 / costs["target"], drafter=1.0 / costs["drafter"], source=source)


def measured_work(run_dir: str | os.PathLike) -> dict[str, dict[str, float]]:
    """Tokens and busy seconds per stage from a run's journal, and how many workers each stage had.

    Target work is every extraction that reached ``ready``; drafter work is every commit the ledger
    still holds (a step rolled back was redone, and its time is not throughput).
    """
    run = read_run(run_dir)
    commits = [c for model_commits in run.commits.values() for c in model_commits]
    return {"target": {"tokens": float(run.tokens_target), "busy_s": run.busy_target,
                       "workers": len(run.worker_names["target"])},
            "drafter": {"tokens": float(sum(c.tokens for c in commits)),
                        "busy_s": sum(c.busy_s for c in commits),
                        "workers": len(run.worker_names["drafter"])}}


def rates_from_run(run_dir: str | os.PathLike) -> StageRates:
    work = measured_work(run_dir)
    for stage in STAGES:
        if work[stage]["busy_s"] <= 0 or work[stage]["tokens"] <= 0:
            raise ValueError(f"{run_dir}: no {stage} work with busy time in the journal yet, nothing to measure")
    workers = ", ".join(f"{work[s]['workers']} {s}s" for s in STAGES)
    return StageRates(target=work["target"]["tokens"] / work["target"]["busy_s"],
                      drafter=work["drafter"]["tokens"] / work["drafter"]["busy_s"],
                      source=f"measured in {run_dir} ({workers})")


# -- the command ---------------------------------------------------------------------------------
def plan_dict(rates: StageRates, num_gpus: int, config_path: str | None = None,
              from_run: str | None = None, *, tp_size: int = 1, memory: TargetMemory | None = None) -> dict[str, Any]:
    splits = plan_splits(rates, num_gpus, tp_size)
    best = recommend(rates, splits)
    return {"gpus": num_gpus, "source": rates.source, "config": config_path, "from_run": from_run,
            "tp_size": tp_size, "target_memory": asdict(memory) if memory is not None else None,
            "rate_per_gpu": {"target": rates.target, "drafter": rates.drafter},
            "splits": [asdict(s) for s in splits], "recommended": asdict(best)}


def _memory_lines(plan: dict[str, Any]) -> list[str]:
    m = plan.get("target_memory")
    if not m:
        return []
    return [f"target of {m['params'] / 1e9:g}B parameters: {m['params'] / 1e9:g}e9 x {BYTES_PER_PARAM} bytes (bf16) = "
            f"{m['weights_gb']:,.0f} GB of weights; tp_size {m['tp_size']}: {m['per_gpu_gb']:,.1f} GB per GPU "
            f"+ {m['reserve_gb']:g} GB for activations = {m['per_gpu_gb'] + m['reserve_gb']:,.1f} GB of "
            f"{m['gpu_memory_gb']:g} GB", ""]


def _idle_words(split: dict[str, Any]) -> str:
    if split["bottleneck"] == "balanced":
        return "balanced, no stage idles"
    idle = "drafters" if split["bottleneck"] == "target" else "targets"
    return f"{idle} idle {split['idle_share']:.1%}"


def format_plan(plan: dict[str, Any]) -> str:
    rate = plan["rate_per_gpu"]
    tp_size = plan.get("tp_size", 1)
    per_target = f"per target ({tp_size} GPUs)" if tp_size > 1 else "per-GPU"
    lines = [f"plan for {plan['gpus']} GPUs; {per_target} capacity target {rate['target']:,.0f} tok/s, "
             f"drafter {rate['drafter']:,.0f} tok/s per GPU ({plan['source']})",
             "", *_memory_lines(plan),
             f"{'targets':>7} {'drafters':>8} {'target cap':>12} {'drafter cap':>12} {'expected':>12}  "
             f"{'bottleneck':<10} {'idle':<22} {'GPU eff':>7}"]
    best = plan["recommended"]
    for s in plan["splits"]:
        mark = "  <- recommended" if (s["targets"], s["drafters"]) == (best["targets"], best["drafters"]) else ""
        lines.append(f"{s['targets']:>7} {s['drafters']:>8} {s['target_capacity']:>12,.0f} "
                     f"{s['drafter_capacity']:>12,.0f} {s['tokens_per_s']:>12,.0f}  {s['bottleneck']:<10} "
                     f"{_idle_words(s):<22} {s['gpu_efficiency']:>7.1%}{mark}")
    lines += ["",
              f"recommended: {best['targets']} target(s) + {best['drafters']} drafter(s): "
              f"{best['tokens_per_s']:,.0f} tok/s expected, {_idle_words(best)}, "
              f"GPU efficiency {best['gpu_efficiency']:.1%}",
              f"  hsd launch --config {plan.get('config') or 'C'}"
              + (" run.dir=NEW_RUN_DIR" if plan.get("from_run") else "")
              + f" target.count={best['targets']} drafter.count={best['drafters']}"
              + (f" target.tp_size={tp_size}" if tp_size > 1 else "")]
    return "\n".join(lines)


def run_plan(*, config_path: str | None, overrides: list[str], num_gpus: int, from_run: str | None,
             as_json: bool, target_params: float | None = None, gpu_memory_gb: float = 80.0,
             reserve_gb: float = 16.0) -> int:
    """``target_params``: size the target's tensor-parallel group from its bf16 weights (else
    ``target.tp_size`` of the config, or of the measured run)."""
    if from_run:
        rates = rates_from_run(from_run)
        config_path = config_path or str(Path(from_run) / "config.yaml")
        config = load_config(config_path, overrides) if Path(config_path).is_file() else Config()
    else:
        config = load_config(config_path, overrides) if (config_path or overrides) else Config()
        rates = rates_from_config(config, f"the sim cost model of {config_path or 'the default config'}")
    memory = tp_size_for(target_params, gpu_memory_gb=gpu_memory_gb, reserve_gb=reserve_gb) if target_params else None
    tp_size = memory.tp_size if memory is not None else config.target.tp_size
    plan = plan_dict(rates, num_gpus, config_path, from_run, tp_size=tp_size, memory=memory)
    print(json.dumps(plan, indent=2) if as_json else format_plan(plan))
    return 0

