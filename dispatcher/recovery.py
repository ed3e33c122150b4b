"""What a restarting dispatcher reads back: the latest ledger snapshot, then the journal after it.

A snapshot (``run_dir/snapshots/snap-NNNNNN/``) holds, for every started epoch, which model
committed each job at which step (two arrays per epoch, ``.npy``), plus each model's step, last commit and
latest checkpoint, and the number of dispatcher starts. It is taken at a journal segment boundary:
snapshot ``N`` covers every segment up to ``journal-N.jsonl``, so a restart replays only the
segments after it. That keeps restart time proportional to the live state, not to the history.
The snapshot is written to a temporary directory and renamed, so a crash mid-write leaves the
previous one in force. An epoch unchanged since the previous snapshot (a finished, sealed one) is not
written again: its files are hard-linked from that snapshot, so a snapshot costs what the open
epochs cost, and each snapshot directory still holds everything a restart needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from common.run.durable import atomic_write
from dispatcher.journal import read_journal
from dispatcher.journal_events import Checkpointed, DispatcherStarted, EpochStarted, ModelRolledBack, StepCommitted

SNAPSHOT_DIR = "snapshots"
_SNAP = re.compile(r"^snap-(\d{6})$")
RECOVERY_EVENTS = (DispatcherStarted, EpochStarted, StepCommitted, ModelRolledBack, Checkpointed)
Replayed = StepCommitted | ModelRolledBack | Checkpointed


@dataclass
class ModelRecord:
    index: int
    step: int = 0
    checkpoint: int = 0
    last_commit: tuple[int, tuple[int, ...]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "step": self.step, "checkpoint": self.checkpoint,
                "last_commit": [self.last_commit[0], list(self.last_commit[1])] if self.last_commit else None}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "ModelRecord":
        last = doc.get("last_commit")
        return cls(index=doc["index"], step=doc["step"], checkpoint=doc["checkpoint"],
                   last_commit=(last[0], tuple(last[1])) if last else None)


@dataclass
class Snapshot:
    segment: int
    num_starts: int
    epochs_started: list[int]
    models: dict[str, ModelRecord]
    commit_step: dict[int, np.ndarray]   # epoch -> [num_jobs] int64 (epochs copied for this snapshot)
    commit_model: dict[int, np.ndarray]  # epoch -> [num_jobs] int32
    linked: dict[int, Path] = field(default_factory=dict)  # epoch -> the earlier snapshot whose files hold it
    versions: dict[int, int] = field(default_factory=dict)  # epoch -> the ledger's version of the copied arrays


@dataclass
class Recovered:
    snapshot: Snapshot | None = None
    snapshot_path: Path | None = None
    num_starts: int = 0
    epochs_started: list[int] = field(default_factory=list)
    events: list[Replayed] = field(default_factory=list)  # the commits, rollbacks and checkpoints after the snapshot


def snapshot_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / SNAPSHOT_DIR


def latest_snapshot_dir(run_dir: str | os.PathLike) -> Path | None:
    root = snapshot_root(run_dir)
    if not root.is_dir():
        return None
    found = sorted((int(m.group(1)), root / m.group(0)) for m in map(_SNAP.match, os.listdir(root)) if m)
    return found[-1][1] if found else None


def write_snapshot(run_dir: str | os.PathLike, snapshot: Snapshot,
                   before_publish: Callable[[], None] | None = None) -> Path:
    """Write ``snapshot`` and publish it (rename into place). ``before_publish`` runs just before the
    rename: the journal segment the snapshot covers must be on disk by then."""
    root = snapshot_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"snap-{snapshot.segment:06d}"

    def write_files(tmp: Path) -> None:
        tmp.mkdir()
        for epoch in snapshot.commit_step:
            np.save(tmp / array_file("commit_step", epoch), snapshot.commit_step[epoch])
            np.save(tmp / array_file("commit_model", epoch), snapshot.commit_model[epoch])
        for epoch, source in snapshot.linked.items():
            for name in ("commit_step", "commit_model"):
                os.link(source / array_file(name, epoch), tmp / array_file(name, epoch))
        (tmp / "state.json").write_text(json.dumps({
            "segment": snapshot.segment, "num_starts": snapshot.num_starts, "epochs_started": snapshot.epochs_started,
            "models": {model: record.to_json() for model, record in snapshot.models.items()}}))
    # durable: every file fsynced (linked ones included), then the directory's entries
    atomic_write(final, write_files, durable=True, tmp_name=f".tmp-{final.name}",
                 before_publish=(lambda _tmp: before_publish()) if before_publish is not None else None)
    for old in root.iterdir():
        match = _SNAP.match(old.name)
        if match and int(match.group(1)) < snapshot.segment:
            shutil.rmtree(old, ignore_errors=True)
    return final


def array_file(name: str, epoch: int) -> str:
    return f"{name}-{epoch:04d}.npy"


def map_arrays(path: Path, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's commit arrays in snapshot ``path``, memory-mapped read-only (plain ndarray views)."""
    return tuple(np.load(path / array_file(name, epoch), mmap_mode="r").view(np.ndarray)
                 for name in ("commit_step", "commit_model"))


def read_snapshot(path: Path) -> Snapshot:
    state = json.loads((path / "state.json").read_text())
    epochs = state["epochs_started"]
    arrays = {e: map_arrays(path, e) for e in epochs}
    return Snapshot(segment=state["segment"], num_starts=state["num_starts"], epochs_started=list(epochs),
                    models={m: ModelRecord.from_json(r) for m, r in state["models"].items()},
                    commit_step={e: a[0] for e, a in arrays.items()},
                    commit_model={e: a[1] for e, a in arrays.items()})


class SnapshotWriter:
    """Writes snapshots on a thread of its own: the arrays are copied on the loop, written off it.

    ``written`` holds the last snapshot written and its directory until the loop takes it
    (:meth:`take_written`), so the loop can seal the finished epochs that snapshot holds.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.written: tuple[Snapshot, Path] | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, snapshot: Snapshot, before_publish: Callable[[], None] | None = None) -> None:
        def write() -> None:
            try:
                self.written = (snapshot, write_snapshot(self.run_dir, snapshot, before_publish))
            except BaseException as exc:  # surfaced by the dispatcher's next check
                self.error = exc
        self._thread = threading.Thread(target=write, name="snapshot-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def take_written(self) -> tuple[Snapshot, Path] | None:
        if self.busy:
            return None
        written, self.written = self.written, None
        return written


def recover(run_dir: str | os.PathLike) -> Recovered:
    out = Recovered()
    path = latest_snapshot_dir(run_dir)
    after = -1
    if path is not None:
        out.snapshot, out.snapshot_path = read_snapshot(path), path
        after = out.snapshot.segment
        out.num_starts = out.snapshot.num_starts
        out.epochs_started = list(out.snapshot.epochs_started)
    for event in read_journal(run_dir, after=after, only=RECOVERY_EVENTS):
        if isinstance(event, DispatcherStarted):
            out.num_starts += 1
        elif isinstance(event, EpochStarted):
            if event.epoch not in out.epochs_started:
                out.epochs_started.append(event.epoch)
        else:
            out.events.append(event)
    return out
