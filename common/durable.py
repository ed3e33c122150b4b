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


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file under ``directory``, then each directory, deepest first: a tree written
    under a temporary name is on disk before it is renamed into place."""
    for parent, _, files in os.walk(directory, topdown=False):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(parent)
