"""``hsd bench pipeline --plot``: per policy, the bucket mix of the consumed stream across the run
(stacked shares in consecutive windows) and each stage's utilization over time.

matplotlib is an optional dependency (``pip install hsdispatch[bench]``), imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.pipeline_figures import busy_intervals, consumed_mix, measurement_window, utilization_timeline
from common.run.records.events import Event

MIX_WINDOWS = 40      # windows of the consumed stream (each about 2.5 % of it)
UTILIZATION_BIN_S = 2.0


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hsdispatch[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def write_plot(path: str | Path, events: dict[str, list[Event]], setup: Any, buckets: list[int]) -> Path:
    """``events``: each policy's journal; ``buckets``: the bucket max lengths (the legend)."""
    plt = require_matplotlib()
    names = list(events)
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 5.6), squeeze=False)
    colors = plt.get_cmap("viridis")(np.linspace(0.05, 0.95, len(buckets)))
    for column, name in enumerate(names):
        run = events[name]
        mix = consumed_mix(run, len(buckets), MIX_WINDOWS)
        ax = axes[0][column]
        x = (np.arange(len(mix)) + 0.5) / max(len(mix), 1)
        ax.stackplot(x, mix.T, colors=colors, labels=[str(b) for b in buckets], step="mid")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"{name}: consumed bucket mix", fontsize=10)
        ax.set_xlabel("share of the consumed stream", fontsize=8)
        ax.tick_params(labelsize=7)
        lo, hi = measurement_window(run)
        intervals = busy_intervals(run)
        ax = axes[1][column]
        for stage, count, color in (("target", setup.num_targets, "tab:orange"),
                                    ("drafter", setup.num_drafters, "tab:blue")):
            t, use = utilization_timeline(intervals[stage], count, lo, hi, UTILIZATION_BIN_S)
            ax.plot(t, use, color=color, linewidth=1.0, label=f"{stage}s ({count})")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{name}: utilization", fontsize=10)
        ax.set_xlabel("seconds since every worker registered", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("share of window", fontsize=8)
    axes[1][0].set_ylabel(f"busy share per {UTILIZATION_BIN_S:g} s", fontsize=8)
    axes[0][-1].legend(title="bucket", fontsize=7, title_fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes[1][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"hsd bench pipeline: {setup.num_targets} targets x {setup.num_drafters} drafters, "
                 f"{setup.samples} samples, seed {setup.seed}", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

