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

Each snapshot's ``state.json`` is written last and carries a manifest: the size and crc32 of every
array file, and a crc32 of its own content. A restart checks the latest snapshot against it; a
damaged one (a file missing, cut short, or with a byte changed) is never used: the restart falls
back to the snapshot before it (the two latest are kept) and replays the journal's segments after
that one, saying so in one line naming the damaged file, and with no snapshot left it replays the
journal from its first segment. Where no fallback holds every segment it needs, it refuses,
naming the file (:class:`SnapshotDamaged`). A snapshot written before manifests existed is read
unchecked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np

from common import faults
from common.run.durable import atomic_write
from common.run.records.events import Checkpointed, DispatcherStarted, EpochStarted, ModelRolledBack, StepCommitted
from common.run.records.journal import archived_segment_numbers, read_journal

log = logging.getLogger("hsd.recovery")

SNAPSHOT_DIR = "snapshots"
STATE_NAME = "state.json"
SNAPSHOT_FORMAT = 2  # state.json: {"format", "state", "files": {name: [size, crc32]}, "crc32"}
KEEP_SNAPSHOTS = 2   # the latest, and the one a restart falls back to when the latest is damaged
_SNAP = re.compile(r"^snap-(\d{6})$")
RECOVERY_EVENTS = (DispatcherStarted, EpochStarted, StepCommitted, ModelRolledBack, Checkpointed)
Replayed = StepCommitted | ModelRolledBack | Checkpointed


class SnapshotDamaged(ValueError):
    """A snapshot file that does not match the manifest written with it (or no manifest that parses)."""

    def __init__(self, path: Path, what: str):
        self.path = path
        super().__init__(f"{path}: {what}")


class ModelRecord(msgspec.Struct, kw_only=True):
    """A model in a snapshot: its index, step, latest checkpoint and last commit (step, job ids)."""

    index: int
    step: int = 0
    checkpoint: int = 0
    last_commit: tuple[int, tuple[int, ...]] | None = None


class SnapshotState(msgspec.Struct, kw_only=True):
    """``state.json``'s state: what a snapshot holds besides its arrays (a snapshot written before
    manifests is this alone; since, it sits in :class:`SnapshotFile`)."""

    segment: int
    num_starts: int
    epochs_started: list[int]
    models: dict[str, ModelRecord]


class SnapshotFile(msgspec.Struct, kw_only=True):
    """``state.json``: the state, and the manifest a restart checks the snapshot against."""

    format: int
    state: dict[str, Any]  # SnapshotState, as the JSON its checksum is computed over
    files: dict[str, list[int]]  # file name -> [size, crc32]
    crc32: int


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


def snapshot_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """The published snapshots, newest first."""
    root = snapshot_root(run_dir)
    if not root.is_dir():
        return []
    found = sorted((int(m.group(1)), root / m.group(0)) for m in map(_SNAP.match, os.listdir(root)) if m)
    return [path for _, path in reversed(found)]


def latest_snapshot_dir(run_dir: str | os.PathLike) -> Path | None:
    found = snapshot_dirs(run_dir)
    return found[0] if found else None


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _state_crc(state: dict[str, Any], files: dict[str, list[int]]) -> int:
    return zlib.crc32(json.dumps({"state": state, "files": files}, sort_keys=True).encode())


def _linked_manifest(source: Path) -> dict[str, list[int]]:
    """The manifest of an earlier snapshot whose files a new one links ({} when it has none)."""
    try:
        return msgspec.convert(json.loads((source / STATE_NAME).read_text()), SnapshotFile).files
    except (OSError, ValueError, msgspec.ValidationError):  # one written before manifests
        return {}


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
        files: dict[str, list[int]] = {}
        for epoch in snapshot.commit_step:
            for name in ("commit_step", "commit_model"):
                path = tmp / array_file(name, epoch)
                files[path.name] = [path.stat().st_size, file_crc32(path)]
        for epoch, source in snapshot.linked.items():
            known = _linked_manifest(source)
            for name in ("commit_step", "commit_model"):
                path = tmp / array_file(name, epoch)
                os.link(source / path.name, path)
                files[path.name] = known.get(path.name) or [path.stat().st_size, file_crc32(path)]
        state = msgspec.to_builtins(SnapshotState(segment=snapshot.segment, num_starts=snapshot.num_starts,
                                                  epochs_started=snapshot.epochs_started, models=snapshot.models))
        record = SnapshotFile(format=SNAPSHOT_FORMAT, state=state, files=files, crc32=_state_crc(state, files))
        (tmp / STATE_NAME).write_text(json.dumps(msgspec.to_builtins(record)))
        faults.fill_disk_at("snapshot", tmp / STATE_NAME)
    # durable: every file fsynced (linked ones included), then the directory's entries
    atomic_write(final, write_files, durable=True, tmp_name=f".tmp-{final.name}",
                 before_publish=(lambda _tmp: before_publish()) if before_publish is not None else None)
    for old in snapshot_dirs(run_dir)[KEEP_SNAPSHOTS:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def array_file(name: str, epoch: int) -> str:
    return f"{name}-{epoch:04d}.npy"


def map_arrays(path: Path, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's commit arrays in snapshot ``path``, memory-mapped read-only (plain ndarray views)."""
    return tuple(np.load(path / array_file(name, epoch), mmap_mode="r").view(np.ndarray)
                 for name in ("commit_step", "commit_model"))


def read_snapshot(path: Path) -> Snapshot:
    """Snapshot ``path``, checked against its manifest first; SnapshotDamaged names what does not match."""
    state_path = path / STATE_NAME
    try:
        doc = json.loads(state_path.read_text())
    except FileNotFoundError:
        raise SnapshotDamaged(state_path, "missing") from None
    except (OSError, ValueError) as exc:
        raise SnapshotDamaged(state_path, f"does not parse ({exc})") from None
    if isinstance(doc, dict) and "format" in doc:
        try:
            record = msgspec.convert(doc, SnapshotFile)
        except msgspec.ValidationError:
            raise SnapshotDamaged(state_path, "its checksum does not match its content") from None
        state, files = record.state, record.files
        if record.crc32 != _state_crc(state, files):
            raise SnapshotDamaged(state_path, "its checksum does not match its content")
        for name, (size, crc) in sorted(files.items()):
            file = path / name
            if not file.is_file():
                raise SnapshotDamaged(file, "missing")
            if file.stat().st_size != size:
                raise SnapshotDamaged(file, f"{file.stat().st_size} bytes, the manifest says {size}")
            if file_crc32(file) != crc:
                raise SnapshotDamaged(file, "its checksum does not match the manifest")
    else:  # written before manifests: read unchecked
        state = doc
    try:
        saved = msgspec.convert(state, SnapshotState)
        arrays = {e: map_arrays(path, e) for e in saved.epochs_started}
        return Snapshot(segment=saved.segment, num_starts=saved.num_starts, epochs_started=list(saved.epochs_started),
                        models=saved.models, commit_step={e: a[0] for e, a in arrays.items()},
                        commit_model={e: a[1] for e, a in arrays.items()})
    except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
        raise SnapshotDamaged(path, f"does not read ({type(exc).__name__}: {exc})") from None


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


def _missing_segment(run_dir: Path, after: int, through: int) -> str | None:
    """The first archived journal segment numbered ``after`` + 1 to ``through`` that is not on disk."""
    present = set(archived_segment_numbers(run_dir))
    for number in range(after + 1, through + 1):
        if number not in present:
            return f"journal-{number:06d}.jsonl"
    return None


def _snapshot_number(path: Path) -> int:
    return int(_SNAP.match(path.name).group(1))


def _usable_snapshot(run_dir: Path) -> tuple[Snapshot | None, Path | None]:
    """The latest snapshot that reads whole; past a damaged one, an older one (then none: the journal
    from its first segment) whose replay has every segment up to the damaged one's, each fallback
    said in one line; SnapshotDamaged when no fallback has the segments it needs."""
    found = snapshot_dirs(run_dir)
    damaged: SnapshotDamaged | None = None
    for path in found:
        try:
            snapshot = read_snapshot(path)
        except SnapshotDamaged as exc:
            log.warning("ledger snapshot %s is damaged (%s): falling back to an older state", path, exc)
            damaged = damaged or exc
            continue
        if damaged is None:
            return snapshot, path
        if _missing_segment(run_dir, snapshot.segment, _snapshot_number(found[0])) is None:
            log.warning("resuming from ledger snapshot %s and the journal after it, not from the damaged %s",
                        path, damaged.path)
            return snapshot, path
    if damaged is None:
        return None, None
    missing = _missing_segment(run_dir, -1, _snapshot_number(found[0]))
    if missing is not None:
        raise SnapshotDamaged(damaged.path, f"{str(damaged).split(': ', 1)[-1]}, and no older state to fall back "
                              f"to has every journal segment after it ({missing} is gone). Restore the file from a "
                              "copy, or start the run again in a new run.dir (docs/corruption.md)")
    log.warning("no whole ledger snapshot: replaying the journal from its first segment, not from the damaged %s",
                damaged.path)
    return None, None


def recover(run_dir: str | os.PathLike) -> Recovered:
    out = Recovered()
    out.snapshot, out.snapshot_path = _usable_snapshot(Path(run_dir))
    after = -1
    if out.snapshot is not None:
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
