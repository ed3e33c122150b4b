"""``hsd bench pipeline``: the fair dispatcher measured against the pipeline it replaces.

Three policies run one after the other on the same samples (same seed, same schedules), each as a
real ``hsd launch`` of sim workers (T targets, D drafters, one process each) in a temporary run
directory, with a length-dependent cost model:

- a target job costs ``sim_cost_per_token`` per token plus ``sim_cost_attention`` per sequence per
  squared bucket length (a batch of 2 sequences of 4096 costs far more than 64 sequences of 128);
- a drafter job costs mostly ``sim_cost_per_sequence`` (DFlash trains a block per anchor, anchors
  are drawn per sequence), plus a little per token.

So long buckets load the targets and short buckets load the drafters: a stretch of the stream
that is not proportional makes one stage wait for the other, which a bounded pool absorbs only
for a few jobs.

Policies:

- ``fair``: interleaved schedule, one shared job queue, deficit pull, min-ready reservoir (the
  defaults of this project);
- ``naive``: shuffled schedule split into per-target queues (job i only to target i mod T), random
  pull, no reservoir (drafters served whenever anything is ready);
- ``random-pool``: shuffled schedule, shared queue, random pull.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.pipeline_figures import pipeline_figures
from common.dataplane.shm_segment import sweep_dead_segments
from common.run.config import ConfigError, load_config
from common.run.records.events import Event
from common.run.records.journal import read_journal
from common.wire.client import run_id_for
from ops.report import build_report

POLICIES: dict[str, tuple[str, ...]] = {
    "fair": ("schedule.order=interleave", "schedule.assignment=shared", "pool.pull=deficit"),
    "naive": ("schedule.order=shuffle", "schedule.assignment=per_target", "pool.pull=random", "pool.min_ready=0"),
    "random-pool": ("schedule.order=shuffle", "schedule.assignment=shared", "pool.pull=random"),
}
JSON_KEYS = ("efficiency", "drafter_wait", "target_idle", "prefix_deviation", "tail_skew", "step_mix",
             "peak_pool_bytes")
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class BenchSetup:
    """What every policy of one bench runs with. The cost model makes the targets the slower stage
    overall (on an idle machine by far; on the 2-core CI box, where each job also pays about 0.2 s
    of CPU-bound overhead per worker, by about 25 %), while the drafters are the slower one on the
    short buckets: a short batch holds 32 times as many sequences as a long one."""
    num_targets: int
    num_drafters: int
    samples: int
    epochs: int
    seed: int
    target_cost_per_token: float = 1e-5     # seconds per token of a target job
    target_cost_attention: float = 2e-8     # seconds per sequence per squared bucket length (4096: 0.67 s a batch)
    drafter_cost_per_token: float = 2e-6    # seconds per token of a drafter micro-batch
    drafter_cost_per_sequence: float = 3e-2  # seconds per sequence (its anchors) of a drafter micro-batch
    slots: int = 24                          # HS pool slots (each one batch)
    min_ready: int = 6                       # the reservoir of fair and random-pool

    def overrides(self, run_dir: Path) -> list[str]:
        return [f"run.dir={run_dir}", f"run.epochs={self.epochs}", f"run.seed={self.seed}",
                f"data.synthetic_samples={self.samples}",
                f"target.count={self.num_targets}", "target.sim=true", "target.hidden_size=8",
                "target.num_capture_layers=1", f"target.sim_cost_per_token={self.target_cost_per_token}",
                f"target.sim_cost_attention={self.target_cost_attention}",
                f"drafter.count={self.num_drafters}", "drafter.sim=true",
                f"drafter.sim_cost_per_token={self.drafter_cost_per_token}",
                f"drafter.sim_cost_per_sequence={self.drafter_cost_per_sequence}",
                f"pool.slots={self.slots}", f"pool.min_ready={self.min_ready}", "pool.transport=shm",
                # a machine this bench shares may stall a worker for a while: that is not a death
                "dispatcher.worker_timeout_s=30"]


def parse_topology(text: str) -> tuple[int, int]:
    try:
        targets, drafters = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--topology {text!r}: expected TARGETSxDRAFTERS, e.g. 5x3") from None
    if targets < 1 or drafters < 1:
        raise ValueError(f"--topology {text!r}: at least one target and one drafter")
    return targets, drafters


def run_policy(name: str, setup: BenchSetup, base_dir: Path, extra: list[str], *, quiet: bool) -> dict[str, Any]:
    """One ``hsd launch`` of the policy; its figures from the journal once it has finished."""
    run_dir = base_dir / name
    overrides = setup.overrides(run_dir) + list(POLICIES[name]) + list(extra)
    load_config(None, overrides)  # a bad override fails here, before any process starts
    log_path = base_dir / f"{name}.log"
    if not quiet:
        print(f"bench pipeline: {name} ({setup.num_targets} targets, {setup.num_drafters} drafters) ...",
              file=sys.stderr, flush=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hsd.cli", "launch", *overrides], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        finally:
            if proc.poll() is None:  # interrupted: stop the launcher, which stops its children
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            sweep_dead_segments(run_id_for(run_dir))
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"policy {name}: hsd launch {'timed out' if code is None else f'exited {code}'}; "
                           f"last output:\n{tail}")
    events = list(read_journal(run_dir))
    figures = pipeline_figures(events, build_report(run_dir), num_targets=setup.num_targets,
                               num_drafters=setup.num_drafters)
    figures["bench_s"] = round(time.monotonic() - started, 1)
    return {"figures": figures, "events": events}


def format_table(result: dict[str, Any]) -> str:
    setup = result["setup"]
    lines = [f"hsd bench pipeline: {setup['num_targets']} targets x {setup['num_drafters']} drafters, "
             f"{setup['samples']} samples, {setup['epochs']} epoch(s), seed {setup['seed']}",
             f"{'policy':<12} {'effic.':>7} {'drafter':>8} {'target':>7} {'prefix':>7} {'tail':>6} {'step':>5} "
             f"{'peak pool':>10} {'window':>7} {'fill':>5} {'drain':>6} {'wall':>6}",
             f"{'':<12} {'':>7} {'wait':>8} {'idle':>7} {'dev.':>7} {'skew':>6} {'mix':>5} "
             f"{'MiB':>10} {'s':>7} {'s':>5} {'s':>6} {'effic.':>6}"]
    for name in POLICIES:
        f = result[name]
        lines.append(f"{name:<12} {f['efficiency']:>7.3f} {f['drafter_wait']:>8.3f} {f['target_idle']:>7.3f} "
                     f"{f['prefix_deviation']:>7.2f} {f['tail_skew']:>6.3f} {f['step_mix']:>5.2f} "
                     f"{f['peak_pool_bytes'] / 2**20:>10.2f} {f['window_s']:>7.1f} {f['fill_s']:>5.2f} "
                     f"{f['drain_s']:>6.2f} {f['wall_efficiency']:>6.3f}")
    lines.append("efficiency: drafter tokens/s between the last worker's registration and the last commit, "
                 "over the slower stage's capacity (its tokens per busy second x its workers); wall: the same "
                 "over the whole run, process start-up included (hsd report)")
    return "\n".join(lines)


def run_pipeline_bench(*, topology: str, samples: int, epochs: int, seed: int, as_json: bool,
                       plot: str | None, overrides: list[str], runs_dir: str | None = None) -> int:
    """Run every policy and print the figures. ``runs_dir``: keep the run directories there (for
    ``hsd report`` or a look at the journals); by default they go to a temporary directory, removed."""
    num_targets, num_drafters = parse_topology(topology)
    if samples < 1 or epochs < 1:
        raise ConfigError("--samples and --epochs must be positive")
    if plot:
        from benchmarks.pipeline_plot import require_matplotlib
        require_matplotlib()  # fail before minutes of runs, not after
    setup = BenchSetup(num_targets, num_drafters, samples, epochs, seed)
    if runs_dir:
        base_dir = Path(runs_dir).resolve()
        base_dir.mkdir(parents=True, exist_ok=True)
        if any((base_dir / name).exists() for name in POLICIES):
            raise ConfigError(f"--runs-dir {base_dir} already holds runs of this bench: give an empty directory")
    else:
        base_dir = Path(tempfile.mkdtemp(prefix="hsd-bench-pipeline-"))
    result: dict[str, Any] = {"setup": {**asdict(setup), "overrides": list(overrides)}}
    events: dict[str, list[Event]] = {}
    # A stopped bench stops the launch it is running (run_policy's cleanup), never leaves it behind.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for name in POLICIES:
            run = run_policy(name, setup, base_dir, overrides, quiet=as_json)
            result[name], events[name] = run["figures"], run["events"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not runs_dir:
            shutil.rmtree(base_dir, ignore_errors=True)
    if plot:
        from benchmarks.pipeline_plot import write_plot
        buckets = load_config(None, setup.overrides(base_dir) + list(overrides)).schedule.buckets
        write_plot(plot, events, setup, buckets)
    print(json.dumps(result, indent=2) if as_json else format_table(result))
    return 0


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt
