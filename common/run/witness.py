"""The witness of exactly-once: which jobs a model's weights have been trained on.

A drafter keeps, in its own training state, the id of every job whose micro-batch went into an
optimizer step it applied. The record is saved with every checkpoint and reloaded with it, so it
always describes the weights beside it. ``hsd report`` compares the final record of every model
against the schedule; it never consults the dispatcher's ledger, so a bug in the ledger cannot
hide itself.

Checkpoints of one model live under ``run_dir/models/<model_id>/``: one directory per step
(``step-00000012``), written to a temporary name and renamed, and a ``latest`` file naming the
newest, replaced atomically. Every model's step directory has the same layout::

    step-00000012/
      trained_jobs.bin  step.json   the witness (little-endian uint64 job ids, in training order)
      model/                        the servable drafter: config.json + model.safetensors, nothing
                                    else a serving engine would load as weights
      training/                     what only resume reads: optimizer, scheduler, RNG, step

:func:`servable_dir` and :func:`training_dir` name the two parts; a backend writes into them through
the ``write_servable`` and ``write_training`` callbacks of :func:`save_checkpoint`, never by path.
A serving engine's loader reads every ``*.safetensors`` of the directory it is given, so the
training state must never sit inside ``model/``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Iterable, TypeVar

import msgspec

from common import faults
from common.run.checkpoint_manifest import MANIFEST_FILE, DamagedCheckpoint, check_manifest, reading, write_manifest
from common.run.durable import atomic_write

log = logging.getLogger("hsd.checkpoint")

WITNESS_FILE = "trained_jobs.bin"
STEP_FILE = "step.json"
LATEST_FILE = "latest"
MODELS_DIR = "models"
SERVABLE_DIR = "model"  # inside a step directory: what a serving engine loads
TRAINING_DIR = "training"  # inside a step directory: what resume loads besides the witness
_MODEL_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class StepRecord(msgspec.Struct, kw_only=True):
    """``step.json``: which model and step a checkpoint holds (checkpoints written before ``model`` or
    ``manifest`` were recorded lack them)."""

    model: str | None = None
    step: int
    num_trained: int = 0  # job ids in the witness
    manifest: str | None = None  # MANIFEST_FILE where the checkpoint has a manifest


def write_step_record(step_dir: Path, record: StepRecord) -> None:
    (step_dir / STEP_FILE).write_text(json.dumps(msgspec.to_builtins(record)))  # the bytes json always wrote


def read_step_record(step_dir: Path) -> StepRecord:
    return msgspec.convert(json.loads((step_dir / STEP_FILE).read_text()), StepRecord, strict=False)


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
    path: Path  # the step directory

    def trained_jobs(self) -> TrainedJobs:
        with reading(self.path / WITNESS_FILE):
            return TrainedJobs.load(self.path)


def servable_dir(checkpoint: Checkpoint | str | os.PathLike) -> Path:
    """The servable drafter of a checkpoint (or of a step directory): point a serving engine here."""
    return _step_path(checkpoint) / SERVABLE_DIR


def training_dir(checkpoint: Checkpoint | str | os.PathLike) -> Path:
    """The training state of a checkpoint (or of a step directory) that resume reads."""
    return _step_path(checkpoint) / TRAINING_DIR


def _step_path(checkpoint: Checkpoint | str | os.PathLike) -> Path:
    return checkpoint.path if isinstance(checkpoint, Checkpoint) else Path(checkpoint)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


WriteFiles = Callable[[Path], None]  # writes a part of a checkpoint into the directory it is given


def save_checkpoint(run_dir: str | os.PathLike, model_id: str, step: int, trained: TrainedJobs, *,
                    write_servable: WriteFiles | None = None, write_training: WriteFiles | None = None,
                    keep_last: int = 3, before_publish: WriteFiles | None = None) -> Checkpoint:
    """Write a model's checkpoint at ``step`` atomically and point ``latest`` at it.

    ``write_servable(directory)`` writes the servable model (``config.json`` + weights) and
    ``write_training(directory)`` the training state, each into its own empty directory of the new
    step directory (:func:`servable_dir`, :func:`training_dir`) before it becomes visible; either
    part is left out when its callback is None. The manifest of every file's size and checksum
    (:mod:`common.run.checkpoint_manifest`) is written last. ``before_publish(tmp)`` runs once every
    file is on disk, just before the rename (tests use it to stop a writer there). Older step
    directories beyond ``keep_last`` are removed, and any newer one: the model went back past it
    (it resumed from an older checkpoint), so it is no longer the model's history.
    """
    root = model_dir(run_dir, model_id)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)

    def write_parts(tmp: Path) -> None:
        tmp.mkdir()
        trained.save(tmp)
        write_step_record(tmp, StepRecord(model=model_id, step=step, num_trained=len(trained), manifest=MANIFEST_FILE))
        for write, part in ((write_servable, servable_dir(tmp)), (write_training, training_dir(tmp))):
            if write is not None:
                part.mkdir()
                write(part)
        faults.fill_disk_at("checkpoint", tmp / MANIFEST_FILE)
        write_manifest(tmp)  # last: a step directory without a valid one is not a checkpoint
    # a checkpoint of this step written before a crash: the new one replaces it
    atomic_write(final, write_parts, durable=True, tmp_name=f".tmp-{final.name}-{os.getpid()}",
                 before_publish=before_publish)
    atomic_write(root / LATEST_FILE, final.name + "\n", durable=True, tmp_name=f".{LATEST_FILE}.tmp")
    steps = _step_dirs(root)
    for newer in (p for p in steps if _step_of(p) > step):
        shutil.rmtree(newer, ignore_errors=True)
    steps = [p for p in steps if _step_of(p) <= step]
    for old in steps[:-keep_last] if keep_last > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    for partial in root.iterdir():  # what a writer killed mid-checkpoint left behind
        match = _PARTIAL.match(partial.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(partial, ignore_errors=True)
    return Checkpoint(model_id, step, final)


@dataclass(frozen=True)
class CheckpointSnapshot:
    """A model's checkpoint at ``step``, taken off its live training state: the witness copied, and
    callbacks that write host copies of the tensors. Writing it (on another thread, while training
    goes on) reads nothing training changes."""

    model_id: str
    step: int
    trained: TrainedJobs
    write_servable: WriteFiles | None = None
    write_training: WriteFiles | None = None
    keep_last: int = 3

    def write(self, run_dir: str | os.PathLike, *, before_publish: WriteFiles | None = None) -> Checkpoint:
        return save_checkpoint(run_dir, self.model_id, self.step, self.trained, write_servable=self.write_servable,
                               write_training=self.write_training, keep_last=self.keep_last,
                               before_publish=before_publish)


_PARTIAL = re.compile(r"^\.tmp-step-\d{8}-(\d+)$")  # save_checkpoint's temporary directory: its writer's pid
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def _step_of(step_dir: Path) -> int:
    return int(_STEP_DIR.match(step_dir.name).group(1))


def _step_dirs(root: Path) -> list[Path]:
    """The model's step directories, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=_step_of)


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
    with reading(path / STEP_FILE):
        return Checkpoint(model_id, read_step_record(path).step, path)


def verified_latest(run_dir: str | os.PathLike, model_id: str) -> Checkpoint | None:
    """The checkpoint ``latest`` names once its files agree with its manifest (one written before
    manifests: as it is); raises :class:`DamagedCheckpoint` naming the file that does not."""
    checkpoint = latest_checkpoint(run_dir, model_id)
    if checkpoint is not None:
        _checked(checkpoint.path, model_id, None)
    return checkpoint


def list_models(run_dir: str | os.PathLike) -> list[str]:
    root = Path(run_dir) / MODELS_DIR
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / LATEST_FILE).exists())


class NoUsableCheckpoint(ValueError):
    """A model has checkpoints and none of them is whole: the message names each damaged file, what
    is wrong with it and what to do."""


T = TypeVar("T")


@dataclass(frozen=True)
class Usable(Generic[T]):
    checkpoint: Checkpoint
    read: T  # what the reader read from it


def newest_usable(run_dir: str | os.PathLike, model_id: str, read: Callable[[Checkpoint], T] | None = None, *,
                  known_good: dict[Path, tuple] | None = None, said: set[str] | None = None) -> Usable[T] | None:
    """The model's newest checkpoint that is whole, and what ``read(checkpoint)`` read from it (the
    witness and the training state a resume loads); None for a model that has none yet.

    The step directories at or below the one ``latest`` names are tried newest first (all of them
    when ``latest`` is missing or damaged). One is whole when every file agrees with its manifest
    (:mod:`common.run.checkpoint_manifest`) and ``read`` reads it without an error; one written
    before manifests existed is verified by ``read`` alone. Each damaged one is logged in one line
    naming the file and what is wrong, with the older checkpoint used instead. When the model has
    checkpoints and none is whole, raises :class:`NoUsableCheckpoint`: the caller refuses to go on,
    it never starts the model afresh beside the damaged files.

    ``known_good``: step directory -> the identity of its manifest, for a caller that checks again
    and again (the dispatcher): a checkpoint already found whole is not read again. ``said``:
    problems already logged, not logged again.
    """
    root = model_dir(run_dir, model_id)
    candidates, damaged = _candidates(root)
    for step_dir in candidates:
        try:
            checkpoint, has_manifest = _checked(step_dir, model_id, known_good)
            with reading(step_dir):
                value = read(checkpoint) if read is not None else None
        except DamagedCheckpoint as exc:
            damaged.append(exc)
            continue
        if not has_manifest and _first_time(said, f"no manifest: {step_dir}"):
            log.info("model %s: checkpoint %s has no manifest (written before checkpoints had one): %s", model_id,
                     step_dir, "verified by loading it" if read is not None else "counted on as it is")
        for problem in damaged:
            if _first_time(said, str(problem)):
                log.warning("model %s: damaged checkpoint, %s: falling back to the older checkpoint at step %d (%s)",
                            model_id, problem, checkpoint.step, step_dir)
        return Usable(checkpoint, value)
    if not damaged:
        return None
    raise NoUsableCheckpoint(
        f"model {model_id}: no usable checkpoint in {root}: " + "; ".join(str(d) for d in damaged)
        + f". Restore the damaged files from a copy, or move {root} aside to train model {model_id} again from "
          f"step 0 (the dispatcher then puts every job it committed back to pending)")


def _first_time(said: set[str] | None, what: str) -> bool:
    if said is None:
        return True
    first = what not in said
    said.add(what)
    return first


def _candidates(root: Path) -> tuple[list[Path], list[DamagedCheckpoint]]:
    """The step directories to try, newest first, and what is wrong with ``latest``."""
    steps = _step_dirs(root)[::-1]
    latest = root / LATEST_FILE
    try:
        name = latest.read_text().strip()
    except FileNotFoundError:  # none written yet, or a writer died before its first ``latest``
        return steps, []
    except (OSError, UnicodeDecodeError) as exc:
        return steps, [DamagedCheckpoint(latest, f"unreadable ({exc})")]
    if not _STEP_DIR.match(name) or not (root / name).is_dir():
        return steps, [DamagedCheckpoint(latest, f"names {name!r}, which is no step directory of this model")]
    return [p for p in steps if _step_of(p) <= _step_of(root / name)], []


def _checked(step_dir: Path, model_id: str, known_good: dict[Path, tuple] | None) -> tuple[Checkpoint, bool]:
    """The checkpoint of ``step_dir`` once its files agree with its manifest, and whether it has one."""
    step_file = step_dir / STEP_FILE
    try:
        meta, unreadable = read_step_record(step_dir), None
    except Exception as exc:  # the manifest says first what is wrong with it, if it lists it
        meta, unreadable = None, exc
    has_manifest = meta is not None and meta.manifest == MANIFEST_FILE
    identity = _identity(step_dir / MANIFEST_FILE) if has_manifest and known_good is not None else None
    if identity is None or known_good.get(step_dir) != identity:
        has_manifest = check_manifest(step_dir, has_manifest=has_manifest)
        if identity is not None:
            known_good[step_dir] = identity
    with reading(step_file):
        if unreadable is not None:
            raise unreadable
        step = meta.step
        if step != _step_of(step_dir) or (meta.model or model_id) != model_id:
            raise DamagedCheckpoint(step_file, f"says model {meta.model!r} step {step}, not the directory's")
    return Checkpoint(model_id, step, step_dir), has_manifest


def _identity(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
