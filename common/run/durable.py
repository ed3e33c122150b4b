"""Durable writes: a file or directory that appears whole or not at all, and survives a power cut.

Every file or directory the project must never leave half written is made under a temporary name
beside its final one and renamed into place (:func:`atomic_write`, or :func:`publish` for a file
written over many calls): a reader sees the old content or the new, never a mix, and a writer killed
midway leaves only its temporary entry.

Creating, renaming (``os.replace``) or removing a file changes its directory, not the file: the
directory itself must be fsynced too, or a crash can keep the data and lose the name. A write that
must survive a power cut (``durable=True``) fsyncs the new content before the rename and the
directory after it; the others (a config copy, a cache, an export that is made again when lost)
only rename.

A write the storage refuses (disk full, quota, an I/O error, a read-only filesystem) raises
:class:`StorageFailed`, whose message names the path and the free space left: every process turns it
into the same fail-closed stop (exit :data:`STORAGE_FAILED_EXIT_CODE`), never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Callable, Union

# A file's whole content, or a callable that writes the file (or builds the directory) at the
# temporary path it is given: for writers that take a name (safetensors, numpy, tarfile, copytree).
Content = Union[str, bytes, Callable[[Path], None]]

STORAGE_FAILED_EXIT_CODE = 3  # a write the storage refused: stopped, having acknowledged nothing that was not durable
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})


class StorageFailed(RuntimeError):
    """A write to disk failed for want of space or by an I/O error: the process must stop (fail closed)."""

    def __init__(self, path: str | os.PathLike, cause: BaseException, *, action: str = "writing"):
        self.path = Path(path)
        self.cause = cause
        super().__init__(describe_storage_failure(self.path, cause, action=action))


def is_storage_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); None if unknown."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def format_bytes(count: int | None) -> str:
    if count is None:
        return "unknown"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def describe_storage_failure(path: str | os.PathLike, cause: BaseException, *, action: str = "writing") -> str:
    """One line: what failed on which path, why, and the free space left there."""
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    return f"{action} {path} failed: {reason} ({format_bytes(free_bytes(path))} free on its filesystem)"


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory: the entries created, renamed or removed in it so far are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file under ``directory``, then each directory, deepest first: a tree written
    under a temporary name is on disk before it is renamed into place."""
    for parent, _, files in os.walk(directory, topdown=False):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(parent)


def atomic_write(path: str | os.PathLike, content: Content, *, durable: bool = False, mode: int | None = None,
                 tmp_name: str | None = None, before_publish: Callable[[Path], None] | None = None) -> Path:
    """Make ``path`` hold ``content``, whole or not at all: written under ``tmp_name`` in the same
    directory (default: ``path``'s name + ``.tmp``), then :func:`publish`\\ ed over ``path``.

    ``content`` is text, bytes, or a callable that writes the temporary path it is given, a file or a
    directory (one a killed writer left there is removed first). When writing fails the temporary
    entry is removed and the error raised; ``path`` is left as it was. ``durable``, ``mode`` and
    ``before_publish``: as :func:`publish`.
    """
    path = Path(path)
    tmp = path.with_name(tmp_name or f"{path.name}.tmp")
    try:
        if isinstance(content, str):
            tmp.write_text(content)
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            content(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return publish(tmp, path, durable=durable, mode=mode, before_publish=before_publish)


def publish(tmp: str | os.PathLike, path: str | os.PathLike, *, durable: bool = False, mode: int | None = None,
            before_publish: Callable[[Path], None] | None = None) -> Path:
    """Rename the complete file or directory ``tmp`` over ``path`` (same directory): the last step of
    :func:`atomic_write`, alone for a file written under its temporary name over many calls.

    ``durable``: ``tmp`` is fsynced first (a directory: every file in it, then each directory), and
    ``path``'s directory after the rename, so the new entry survives a power cut. ``mode``: set on
    ``tmp`` before the rename (whatever the umask). ``before_publish(tmp)`` runs just before the
    rename, once everything is written (and fsynced): tests stop a writer there. A directory at
    ``path`` is removed first (``os.replace`` cannot replace a non-empty one): between the two, neither
    is there.
    """
    tmp, path = Path(tmp), Path(path)
    is_dir = tmp.is_dir()
    try:
        if mode is not None:
            os.chmod(tmp, mode)
        if durable:
            if is_dir:
                fsync_tree(tmp)
            else:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
        if before_publish is not None:
            before_publish(tmp)
    except BaseException:  # nothing half-written is left beside the last good one
        _remove(tmp)
        raise
    if is_dir and path.is_dir():
        shutil.rmtree(path)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)
    return path


def _remove(tmp: Path) -> None:
    """Best effort: the error that made the write fail is the one to raise."""
    with contextlib.suppress(OSError):
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)
