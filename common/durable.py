"""Durable writes: what makes a new or renamed entry of a directory survive a power cut.

Creating, renaming (``os.replace``) or removing a file changes its directory, not the file: the
directory itself must be fsynced too, or a crash can keep the data and lose the name.
"""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory: the entries created, renamed or removed in it so far are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
