"""``hsd bench balance``: the all-reduce wait of a drafter group, count- vs cost-balanced steps.

Each setup is run twice, the same seed and epochs, differing only in ``drafter.step_balance``:

- ``dflash``: the demo's tiny target and prepared data, a group of ``--ranks`` DFlash drafters on
  the CPU (real compute: on a small shared host its timings are noisy);
- ``modeled``: sim targets over the synthetic length distribution, a group of linear-backend
  drafters that also spend a modeled DFlash cost per sequence (``drafter.sim_cost_per_sequence``:
  a sleep, so the host's load does not blur it), which makes micro-batches of many short
  sequences dear and ones of few long sequences cheap.

Each run's journal gives the figures (``hsd report``): rank 0's wait at the gradient all-reduce as
a share of its step time (``allreduce_wait_share``), and every rank's wait for the step's slowest
rank, from the compute time each measured, as a share of the ranks' step time
(``rank_wait_share``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

from common.run.config import ConfigError, StepBalance, load_config
from common.run.records.events import StepCommitted
from common.run.records.journal import read_journal
from ops.report import build_report

POLICIES = get_args(StepBalance)
SETUPS = ("modeled", "dflash")
SLOTS = 24  # a deep pool: the ranks rarely wait for hidden states, so their waits are each other's
MODELED = ["target.sim=true", "target.hidden_size=16", "target.num_capture_layers=2", "target.sim_cost_per_token=1e-6",
           "drafter.backend=linear", "drafter.sim_cost_per_sequence=4e-3", "data.synthetic_samples=800"]


def _run(policy: str, inputs: list[str], config_file: Path | None, run_dir: Path, *, ranks: int, epochs: int,
         seed: int, accum_steps: int) -> dict:
    from ops.launch import Launcher
    shutil.rmtree(run_dir, ignore_errors=True)
    config = load_config(config_file, [*inputs, f"run.dir={run_dir}", f"run.epochs={epochs}", f"run.seed={seed}",
                                       f"drafter.count={ranks}", "drafter.data_parallel=true",
                                       f"drafter.step_balance={policy}", "drafter.checkpoint_every=1000",
                                       f"pool.slots={SLOTS}", f"drafter.accum_steps={accum_steps}"])
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the run's log lines; stdout is the figures' (--json)
        code = Launcher(config).run()
    wall_s = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"the {policy}-balanced run failed (exit code {code}); logs in {run_dir / 'logs'}")
    report = build_report(run_dir)
    commits = [e for e in read_journal(run_dir, only=(StepCommitted,)) if e.rank_busy_s]
    jobs_per_rank = [n for e in commits for n in e.rank_jobs]
    return {"step_balance": policy, "group_steps": report.get("group_steps", 0),
            "allreduce_wait_share": report.get("allreduce_wait_share", 0.0),
            "rank_wait_share": report.get("rank_wait_share", 0.0),
            "median_step_ms": round(1000 * statistics.median(e.step_s for e in commits), 1) if commits else 0.0,
            "jobs_per_rank_range": [min(jobs_per_rank), max(jobs_per_rank)] if jobs_per_rank else [0, 0],
            "witness_duplicates": report["witness_duplicates"], "witness_missing": report["witness_missing"],
            "wall_s": round(wall_s, 1)}


def format_results(results: list[dict]) -> str:
    lines = ["setup    step_balance  steps  rank-0 all-reduce wait  ranks' wait for the slowest  median step  "
             "micro-batches per rank  witness dup/missing  wall"]
    for r in results:
        low, high = r["jobs_per_rank_range"]
        lines.append(f"{r['setup']:<7}  {r['step_balance']:<12}  {r['group_steps']:>5}  {r['allreduce_wait_share']:>22.1%}  "
                     f"{r['rank_wait_share']:>28.1%}  {r['median_step_ms']:>8.0f} ms  {low:>10}..{high:<11}  "
                     f"{r['witness_duplicates']}/{r['witness_missing']:<17}  {r['wall_s']:.0f}s")
    return "\n".join(lines)


def run_balance_bench(*, setups: tuple[str, ...] = SETUPS, ranks: int = 2, epochs: int = 3, accum_steps: int = 4,
                      seed: int = 0, inputs_dir: str = "runs/demo", work_dir: str | None = None,
                      as_json: bool = False) -> int:
    if ranks < 2 or epochs < 1 or accum_steps < 1:
        raise ConfigError("hsd bench balance needs --ranks >= 2, --epochs >= 1 and --accum-steps >= 1")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise ConfigError(f"hsd bench balance: --setup is one of {', '.join(SETUPS)}, not {', '.join(unknown)}")
    from benchmarks.chaos_setups import real_inputs
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks and the target share the machine's cores
    base = Path(work_dir or tempfile.mkdtemp(prefix="hsd-balance-")).resolve()
    results = []
    for setup in setups:
        if setup == "dflash":
            inputs, config_file = real_inputs(Path(inputs_dir))
        else:
            inputs, config_file = MODELED, None
        for policy in POLICIES:
            print(f"hsd bench balance: {setup}, {ranks} ranks, {epochs} epoch(s), step_balance={policy} ...",
                  file=sys.stderr, flush=True)
            run = _run(policy, inputs, config_file, base / f"{setup}-{policy}", ranks=ranks, epochs=epochs,
                       seed=seed, accum_steps=accum_steps)
            results.append({"setup": setup, **run})
    print(json.dumps({"ranks": ranks, "epochs": epochs, "accum_steps": accum_steps, "seed": seed, "runs": results})
          if as_json
          else format_results(results), flush=True)
    if work_dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r["witness_duplicates"] == 0 and r["witness_missing"] == 0 for r in results) else 1
