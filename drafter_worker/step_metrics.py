"""Step metrics of a drafter worker (DFlash or EAGLE-3): one log line per step, TensorBoard when installed.

The worker loop interleaves waiting for data (``get_hs``, the slot copy, the commit round trip) with
computing on it; the backend only sees its own calls, so it measures a step's wall time from the end
of the previous step to the end of this one and its compute time as the time spent inside
``micro_batch`` and ``apply_step``. What is left is the share of the step spent waiting for data.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

# Accuracy is reported at the first few block positions: they set most of the acceptance length.
NUM_ACCURACY_POSITIONS = 3


class StepClock:
    """Wall time and compute time of the step being accumulated."""

    def __init__(self) -> None:
        self.step_started = time.perf_counter()
        self.compute_s = 0.0
        self.num_tokens = 0

    def add_compute(self, seconds: float, num_tokens: int = 0) -> None:
        self.compute_s += seconds
        self.num_tokens += num_tokens

    def finish(self) -> tuple[float, float, int]:
        """(wall seconds, compute seconds, tokens) of the step; the next step starts now."""
        now = time.perf_counter()
        wall, compute, tokens = now - self.step_started, self.compute_s, self.num_tokens
        self.step_started, self.compute_s, self.num_tokens = now, 0.0, 0
        return wall, compute, tokens

    def drop(self) -> None:
        self.compute_s, self.num_tokens = 0.0, 0


def step_metrics(stats, *, wall_s: float, compute_s: float, num_tokens: int) -> dict[str, float]:
    """A small flat map of floats: what the log line, TensorBoard and ``hsd stats`` show."""
    metrics = {"loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
               "tokens_per_s": num_tokens / wall_s if wall_s > 0 else 0.0,
               "data_wait": max(0.0, 1.0 - compute_s / wall_s) if wall_s > 0 else 0.0}
    for k, acc in enumerate(stats.accuracy[:NUM_ACCURACY_POSITIONS], start=1):
        metrics[f"acc{k}"] = acc
    return {key: float(value) for key, value in metrics.items()}


def format_metrics(model_id: str, step: int, metrics: dict[str, float]) -> str:
    accuracy = " ".join(f"{metrics[f'acc{k}']:.3f}" for k in range(1, NUM_ACCURACY_POSITIONS + 1)
                        if f"acc{k}" in metrics)
    loss = metrics["loss"]
    return (f"{model_id} step {step:5d}  loss {loss:.4f}  acc@1..3 {accuracy}  lr {metrics['lr']:.2e}  "
            f"grad_norm {metrics['grad_norm']:.3f}  tok/s {metrics['tokens_per_s']:,.0f}  "
            f"data_wait {100 * metrics['data_wait']:.0f}%" if not math.isnan(loss) else
            f"{model_id} step {step:5d}  (no supervised positions)")


class TensorBoardLog:
    """Scalars under ``run.dir/tb/<model>`` when ``torch.utils.tensorboard`` imports; nothing otherwise."""

    def __init__(self, run_dir: str | os.PathLike, model_id: str):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional: the log line carries the same figures
            return
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb" / model_id))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
