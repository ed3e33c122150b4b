"""The run directory's own files: the serving dispatcher's state file, the run's copy of the sample
lengths, and the free space a run needs there. The dispatcher writes them; ``hsd launch``, the
report and the benchmarks read them here, never through the daemon's modules."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np

from common.run.config import ConfigError
from common.run.durable import atomic_write, format_bytes, free_bytes
from common.run.witness import MODELS_DIR

STATE_FILE = "dispatcher.json"  # pid and endpoints of the serving dispatcher; hsd launch waits for it
LENGTHS_FILE = "lengths.npy"  # the run's sample lengths, written once: every epoch's schedule is built from it
JOURNAL_HEADROOM_BYTES = 64 << 20  # journal segments and snapshots written between two checkpoints


class DispatcherState(msgspec.Struct, kw_only=True):
    """``dispatcher.json``: the serving dispatcher, written once it is bound, removed when it stops."""

    pid: int
    host: str
    run_id: str
    control: str  # the control endpoint
    stats: str  # the stats endpoint
    started: float  # wall-clock seconds


def write_state_file(run_dir: str | os.PathLike, state: DispatcherState) -> None:
    atomic_write(Path(run_dir) / STATE_FILE, msgspec.json.encode(state))


def read_state_file(run_dir: str | os.PathLike) -> DispatcherState | None:
    """The serving dispatcher's state, or None where no whole state file is there (none yet, or gone)."""
    try:
        return msgspec.json.decode((Path(run_dir) / STATE_FILE).read_bytes(), type=DispatcherState)
    except (OSError, msgspec.DecodeError):
        return None


def write_run_lengths(run_dir: str | os.PathLike, lengths: list[int] | np.ndarray) -> None:
    path = Path(run_dir) / LENGTHS_FILE
    atomic_write(path, lambda tmp: np.save(tmp, lengths), tmp_name=path.with_suffix(".tmp.npy").name)


def read_run_lengths(run_dir: str | os.PathLike) -> np.ndarray | None:
    """The run's sample lengths, memory-mapped, or None before the dispatcher has written them."""
    path = Path(run_dir) / LENGTHS_FILE
    return np.load(path, mmap_mode="r") if path.is_file() else None


def largest_checkpoint_bytes(run_dir: Path) -> int:
    """The size of the largest checkpoint (``models/<model>/step-*``) already in ``run_dir``."""
    largest = 0
    for step_dir in (run_dir / MODELS_DIR).glob("*/step-*"):
        if step_dir.is_dir():
            largest = max(largest, sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()))
    return largest


def check_free_space(run_dir: Path, min_free_mb: int) -> None:
    """Refuse to start where ``run_dir`` cannot hold one more checkpoint set and the journal's headroom:
    ``min_free_mb``, or with 0 the largest checkpoint already there plus JOURNAL_HEADROOM_BYTES."""
    needed = min_free_mb << 20 if min_free_mb else largest_checkpoint_bytes(run_dir) + JOURNAL_HEADROOM_BYTES
    free = free_bytes(run_dir)
    if free is not None and free < needed:
        raise ConfigError(f"run.dir {run_dir} has {format_bytes(free)} free, less than the {format_bytes(needed)} a "
                          "run needs there (one checkpoint set and the journal's headroom; run.min_free_mb sets "
                          "it): free space or choose another run.dir")
