"""``hsd demo``: the whole pipeline on the CPU, from nothing to a trained DFlash drafter and its tau.

1. ``make-tiny``: a small Qwen3 target trained on a synthetic chat language (reused when present);
2. ``regenerate``: the target's own greedy answers to the first ``--samples`` training prompts
   (a drafter learns to predict what its target says, not what a dataset says);
3. ``prepare``: tokenized into a prepared dataset;
4. ``launch``: dispatcher, a real target process and a real DFlash drafter process, through the
   shared-memory data plane (``deploy/configs/demo-real.yaml``);
5. ``evaluate``: speculative decoding on held-out prompts, tau of the untrained drafter (the same
   initial weights) and of the trained one.

The last line printed is one JSON object with the figures, for scripts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

from common.run.config import ConfigError, load_config
from common.run.drafter_family import DEFAULT_OBJECTIVE, families, family_of
from common.run.records.events import Checkpointed, StepCommitted
from common.run.records.journal import read_journal
from ops.configs import bundled_config

log = logging.getLogger("hsd.demo")

# The package's own copies (deploy/configs in a checkout).
DEFAULT_CONFIG = bundled_config("demo-real.yaml")
DRAFTER_NAME = "drafter-0"  # the name hsd launch gives its first drafter


def demo_objectives() -> list[str]:
    """The drafter families ``hsd demo --objective`` takes: those with demo defaults."""
    return [family.objective for family in families() if family.demo is not None]


def _stage(number: int, text: str) -> float:
    print(f"[demo {number}/5] {text}", flush=True)
    return time.perf_counter()


def _done(started: float, what: str) -> float:
    seconds = time.perf_counter() - started
    print(f"          {what} ({seconds:.0f}s)", flush=True)
    return seconds


def _first_rows(source: Path, out: Path, count: int) -> Path:
    with open(source, encoding="utf-8") as lines, open(out, "w", encoding="utf-8") as dest:
        for number, line in enumerate(lines):
            if number >= count:
                break
            dest.write(line)
    return out


def _step_figures(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, tokens/s) of each applied step with a loss, from the run's journal: a commit
    carries the figures of the step before it, a checkpoint those of its own step (so the last
    step's are there too); a step trained again after a resume keeps its last figures. The loss is
    rounded as the drafter's log line shows it."""
    steps: dict[int, tuple[float, float]] = {}
    for event in read_journal(run_dir, only=(StepCommitted, Checkpointed)):
        figures = event.metrics
        if event.model == DRAFTER_NAME and figures and "loss" in figures and "tokens_per_s" in figures:
            # a figure that was not a number is journaled as null
            loss, rate = (math.nan if v is None else v for v in (figures["loss"], figures["tokens_per_s"]))
            steps[int(figures["step"])] = (round(loss, 4), rate)
    return [(step, *steps[step]) for step in sorted(steps)]


def prepare_inputs(out: Path, *, config_path: str | os.PathLike | None, overrides: list[str], samples: int,
                   tiny_steps: int | None = None, timings: dict[str, float]) -> list[str]:
    """Stages 1-3 under ``out``: the tiny target (``out/target``), the target's own answers and the
    prepared dataset (``out/data``), each reused when already made from the same inputs. Returns
    ``overrides`` plus what points a run at them (``target.model``, ``data.path``, the mask token)."""
    out.mkdir(parents=True, exist_ok=True)
    target_dir, data_dir = out / "target", out / "data"
    from target_worker.tiny import TinySpec, make_tiny
    started = _stage(1, f"tiny target in {target_dir} (built once, then reused)")
    tiny = make_tiny(target_dir, seed=0, spec=TinySpec() if tiny_steps is None else TinySpec(steps=tiny_steps))
    timings["make_tiny"] = _done(started, f"greedy answer match on held-out turns {tiny['match_rate_trained']:.3f}")

    config = load_config(config_path or DEFAULT_CONFIG,
                         [*overrides, f"run.dir={out / 'run'}", f"target.model={target_dir}", "data.path="])
    from target_worker.regenerate import regenerate_file
    started = _stage(2, f"the target's own greedy answers to {samples} training prompts")
    regenerated = out / "regenerated.jsonl"
    previous = (out / "prompts.jsonl").read_bytes() if (out / "prompts.jsonl").is_file() else None
    subset = _first_rows(target_dir / "conversations.jsonl", out / "prompts.jsonl", samples)
    if regenerated.is_file() and previous == subset.read_bytes():
        timings["regenerate"] = _done(started, f"{regenerated} (reused: same target, same prompts)")
    else:
        regenerate_file(config, subset, regenerated, max_new_tokens=128, batch_size=32)
        timings["regenerate"] = _done(started, f"{regenerated}")

    from target_worker.prepare import prepare_dataset
    started = _stage(3, "prepare: tokenize with the target's tokenizer")
    manifest = prepare_dataset(regenerated, target_dir, data_dir, max_length=config.schedule.buckets[-1],
                               progress=False)
    timings["prepare"] = _done(started, f"{manifest['num_samples']} samples, {manifest['num_tokens']} tokens")
    return [*overrides, f"target.model={target_dir}", f"data.path={data_dir}"]


def run_demo(*, out: str | os.PathLike, config_path: str | os.PathLike | None, overrides: list[str], samples: int,
             eval_prompts: int, max_new_tokens: int, tiny_steps: int | None = None,
             objective: str = DEFAULT_OBJECTIVE) -> int:
    if samples <= 0 or eval_prompts <= 0 or max_new_tokens <= 0:
        raise ConfigError("--samples, --eval-prompts and --max-new-tokens must be positive")
    if objective not in demo_objectives():
        raise ConfigError(f"--objective {objective!r} is not one of {', '.join(demo_objectives())}")
    family = family_of(objective)
    # Per drafter family: its config, its run directory under --out (the demos share the target and
    # data) and its name in the summary.
    run_name, drafter_kind = family.demo.run_name, family.title
    config_path = config_path or bundled_config(family.demo.config_name)
    overrides = [f"drafter.objective={objective}", *overrides]
    import torch

    torch.set_num_threads(1)  # the demo's stages share the machine with each other's processes
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the launched workers
    out = Path(out).resolve()
    run_dir = out / run_name
    timings: dict[str, float] = {}
    began = time.perf_counter()
    inputs = prepare_inputs(out, config_path=config_path, overrides=overrides, samples=samples,
                            tiny_steps=tiny_steps, timings=timings)
    target_dir = out / "target"
    config = load_config(config_path or DEFAULT_CONFIG, [*inputs, f"run.dir={run_dir}"])
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time: the figures describe this one
    from ops.launch import Launcher
    started = _stage(4, f"launch: dispatcher + {config.target.count} target + {config.drafter.count} {drafter_kind} drafter "
                        f"process(es), {config.run.epochs} epoch(s), shm data plane")
    code = Launcher(config).run()
    timings["train"] = _done(started, f"hsd launch exited {code}")
    if code != 0:
        print(f"demo: the run failed (exit code {code}); logs in {run_dir / 'logs'}")
        return code

    from common.run.witness import latest_checkpoint, servable_dir
    from drafter_worker.speculative_eval import evaluate
    from drafter_worker.eval_prompts import load_chat_prompts
    from drafter_worker.factory import trainer_backend
    from transformers import AutoModelForCausalLM, AutoTokenizer
    started = _stage(5, f"speculative decoding on {eval_prompts} held-out prompts, before and after training")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_chat_prompts(target_dir / "heldout.jsonl", tokenizer, eval_prompts)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    untrained = trainer_backend(config, "untrained", schedule_jobs=1).trainer.model.eval()  # the run's initial weights
    before = evaluate(target_dir, untrained, prompts, max_new_tokens, target=target)
    drafter_dir = servable_dir(latest_checkpoint(run_dir, DRAFTER_NAME))
    after = evaluate(target_dir, drafter_dir, prompts, max_new_tokens, target=target)
    timings["eval"] = _done(started, f"tau {before['tau']:.2f} -> {after['tau']:.2f}")

    steps = _step_figures(run_dir)
    from ops.report import build_report
    report = build_report(run_dir)
    summary = {
        "tau_before": round(before["tau"], 3),
        "tau_after": round(after["tau"], 3),
        "acceptance_after": [round(r, 3) for r in after["per_position"]],
        "loss_first": steps[0][1] if steps else None,
        "loss_last": steps[-1][1] if steps else None,
        "steps": len(steps),
        "tokens_per_s": round(statistics.median(s[2] for s in steps), 1) if steps else None,
        "witness_duplicates": report["witness_duplicates"],
        "witness_missing": report["witness_missing"],
        "seconds": {k: round(v, 1) for k, v in timings.items()} | {"total": round(time.perf_counter() - began, 1)},
        "drafter": str(drafter_dir),
        "run_dir": str(run_dir),
    }
    shape = family.demo.shape(after["block_size"])
    print(f"\n{drafter_kind} drafter ({shape}) trained online on {report['jobs_total']} jobs of the "
          f"target's hidden states in {len(steps)} steps: loss {summary['loss_first']} -> {summary['loss_last']}, "
          f"{summary['tokens_per_s']} tok/s per drafter step (median)")
    print(f"mean acceptance length tau on {len(prompts)} held-out prompts: {before['tau']:.2f} untrained -> "
          f"{after['tau']:.2f} trained (output equal to the target's greedy output)")
    print(f"exactly once: witness duplicates {report['witness_duplicates']}, missing {report['witness_missing']}; "
          f"drafter exported to {drafter_dir} (serve it as it is); total {summary['seconds']['total']:.0f}s")
    print(json.dumps(summary))
    return 0
