"""The witness of exactly-once: which jobs a model's weights have been trained on.

A drafter keeps, in its own training state, the id of every job whose micro-batch went into an
optimizer step it applied. The record is saved with every checkpoint and reloaded with it, so it
always describes the weights beside it. ``hsd report`` compares the final record of every model
against the schedule; it never consults the dispatcher's ledger, so a bug in the ledger cannot
hide itself.

Checkpoints of one model live under ``run_dir/models/<model_id>/``: one directory per step
(``step-00000012``), written to a temporary name and renamed, and a ``latest`` file naming the
newest, replaced atomically. Whatever else a drafter saves (weights, optimizer) goes in the same
step directory; this module only writes ``trained_jobs.bin`` (little-endian uint64 job ids, in
training order) and ``step.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from common.durable import fsync_dir

WITNESS_FILE = "trained_jobs.bin"
STEP_FILE = "step.json"
LATEST_FILE = "latest"
MODELS_DIR = "models"
_MODEL_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_model_id(model_id: str) -> str:
    if not _MODEL_ID.match(model_id) or model_id in (".", ".."):
        raise ValueError(f"model id {model_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return model_id


def model_dir(run_dir: str | os.PathLike, model_id: str) -> Path:
    return Path(run_dir) / MODELS_DIR / check_model_id(model_id)


class TrainedJobs:
    """The ordered list of job ids a model was trained on (one entry per job per optimizer step)."""

    def __init__(self, job_ids: Iterable[int] = ()):
        self._ids = array("Q", job_ids)

    def add(self, job_ids: Iterable[int]) -> None:
        self._ids.extend(job_ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self):
        return iter(self._ids)

    def copy(self) -> "TrainedJobs":
        return TrainedJobs(self._ids)

    def to_bytes(self) -> bytes:
        ids = array("Q", self._ids)
        if os.sys.byteorder != "little":
            ids.byteswap()
        return ids.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TrainedJobs":
        if len(data) % 8:
            raise ValueError(f"a witness file holds whole uint64 ids, got {len(data)} bytes")
        ids = array("Q")
        ids.frombytes(data)
        if os.sys.byteorder != "little":
            ids.byteswap()
        out = cls()
        out._ids = ids
        return out

    def save(self, directory: Path) -> None:
        (directory / WITNESS_FILE).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, directory: Path) -> "TrainedJobs":
        return cls.from_bytes((directory / WITNESS_FILE).read_bytes())


@dataclass(frozen=True)
class Checkpoint:
    model_id: str
    step: int
    path: Path

    def trained_jobs(self) -> TrainedJobs:
        return TrainedJobs.load(self.path)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(run_dir: str | os.PathLike, model_id: str, step: int, trained: TrainedJobs, *,
                    write_extra: Callable[[Path], None] | None = None, keep_last: int = 3) -> Checkpoint:
    """Write a model's checkpoint at ``step`` atomically and point ``latest`` at it.

    ``write_extra(directory)`` writes the drafter's own files (weights, optimizer) into the new
    directory before it becomes visible. Older step directories beyond ``keep_last`` are removed.
    """
    root = model_dir(run_dir, model_id)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trained.save(tmp)
    (tmp / STEP_FILE).write_text(json.dumps({"model": model_id, "step": step, "num_trained": len(trained)}))
    if write_extra is not None:
        write_extra(tmp)
    for name in os.listdir(tmp):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():  # a checkpoint of this step written before a crash: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".{LATEST_FILE}.tmp"
    latest_tmp.write_text(final.name + "\n")
    with open(latest_tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, root / LATEST_FILE)
    fsync_dir(root)
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[:-keep_last] if keep_last > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    for partial in root.iterdir():  # what a writer killed mid-checkpoint left behind
        match = _PARTIAL.match(partial.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(partial, ignore_errors=True)
    return Checkpoint(model_id, step, final)


_PARTIAL = re.compile(r"^\.tmp-step-\d{8}-(\d+)$")  # save_checkpoint's temporary directory: its writer's pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def latest_checkpoint(run_dir: str | os.PathLike, model_id: str) -> Checkpoint | None:
    """The checkpoint ``latest`` names, or None for a model that has none yet."""
    root = model_dir(run_dir, model_id)
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    meta = json.loads((path / STEP_FILE).read_text())
    return Checkpoint(model_id, int(meta["step"]), path)


def list_models(run_dir: str | os.PathLike) -> list[str]:
    root = Path(run_dir) / MODELS_DIR
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / LATEST_FILE).exists())
