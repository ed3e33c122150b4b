"""The two runs ``hsd bench chaos`` drives (sim, and ``--real``: the demo's tiny target and a DFlash
group), sized so that the plan's events fall inside the work, and the demo inputs the real one reads."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from common.run.config import DrafterSection

EVENTS_PER_WINDOW = 20      # about 13 kills: a window of any length hits every role more than once


@dataclass(frozen=True)
class ChaosSetup:
    """The run a chaos bench drives: its config overrides, its drafters and the plan's pace."""
    overrides: tuple[str, ...]
    num_targets: int
    num_drafters: int
    min_drafters: int           # a detach never leaves fewer live drafters than this
    max_drafters: int           # an attach never makes more
    mean_gap_s: float           # between chaos events
    paired_attach: bool         # attaches only where a drafter detached (a fixed-size group)
    settle_timeout_s: float     # after the window: how long the run may take to finish
    config_file: Path | None = None  # the base config the overrides apply to (None: the defaults)


def sim_setup(run_dir: Path, minutes: float, seed: int) -> ChaosSetup:
    # The 2 sim targets extract at most 12 jobs/s (0.16 s a job each), about 4.5 under chaos on the
    # loaded 2-core CI machine. At least 100 samples (90 jobs over the 3 epochs): the plan's events
    # are due at shares of those jobs, and a machine that works faster than the plan's clock has its
    # targets held until the clock catches up, so every event fires inside the work. A target held
    # longer than the dispatcher's worker timeout would be declared dead: 10 s, above a gap.
    samples = max(100, int(minutes * 60 * 6))
    return ChaosSetup(
        overrides=(f"run.dir={run_dir}", f"run.seed={seed}", "run.epochs=3", f"data.synthetic_samples={samples}",
                   "target.sim=true", "drafter.sim=true", "target.count=2", "drafter.count=2",
                   "target.sim_cost_per_token=2e-5", "drafter.accum_steps=2", "drafter.checkpoint_every=4",
                   "dispatcher.heartbeat_s=0.2", "dispatcher.worker_timeout_s=10"),
        num_targets=2, num_drafters=2, min_drafters=1, max_drafters=4,
        mean_gap_s=max(1.0, minutes * 60 / EVENTS_PER_WINDOW), paired_attach=False, settle_timeout_s=120 + minutes * 60)


def real_setup(run_dir: Path, minutes: float, seed: int, inputs: list[str], config_file: Path) -> ChaosSetup:
    # The demo's recipe in a group of 2 DFlash ranks: 5-19 epochs (39 jobs) a minute here under
    # chaos, as the machine's load goes, and 19 on a quiet machine with sorted batching and
    # cost-balanced steps (at 15 epochs a minute of window the run ended with 2 of its events not
    # yet fired): 25 a minute outlast the window. A group whose size is elastic (drafter.min_ranks)
    # takes attaches beyond its size; a fixed one only where a rank left.
    elastic = "min_ranks" in {f.name for f in dataclasses.fields(DrafterSection)}
    return ChaosSetup(
        overrides=(*inputs, f"run.dir={run_dir}", f"run.seed={seed}", f"run.epochs={max(4, int(minutes * 25))}",
                   "target.count=1", "drafter.count=2", "drafter.checkpoint_every=10",
                   "drafter.collective_timeout_s=20", "dispatcher.heartbeat_s=0.5", "dispatcher.worker_timeout_s=10"),
        num_targets=1, num_drafters=2, min_drafters=2 if elastic else 1, max_drafters=4 if elastic else 2,
        mean_gap_s=max(4.0, minutes * 60 / EVENTS_PER_WINDOW), paired_attach=not elastic,
        settle_timeout_s=300 + minutes * 120, config_file=config_file)


def real_inputs(inputs_dir: Path) -> tuple[list[str], Path]:
    """The demo's config, tiny target and prepared data under ``inputs_dir`` (made once, then reused)."""
    from ops.demo import DEFAULT_CONFIG, prepare_inputs
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the figures' (--json)
        overrides = prepare_inputs(inputs_dir.resolve(), config_path=None, overrides=[], samples=200, timings={})
    return overrides, DEFAULT_CONFIG
