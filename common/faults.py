"""Faults a test switches on through the environment, to force the order of events it needs.

Each fires once per run directory (a marker file there keeps a restarted process from firing it
again) and only where its variable is set; production runs never set them.
"""

from __future__ import annotations

import os
from pathlib import Path

# The dispatcher exits (os._exit) once the commit of a model step >= N is durable in the journal and
# before its reply is sent: the drafter never hears that its step committed.
EXIT_BEFORE_COMMIT_REPLY_ENV = "HSD_TEST_DISPATCHER_EXIT_BEFORE_COMMIT_REPLY"


def fires_once(run_dir: str | os.PathLike, name: str) -> bool:
    """True the first time ``name`` is asked for in ``run_dir`` (the marker file is made then)."""
    marker = Path(run_dir) / f"test-fault-{name}"
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def exit_before_commit_reply(run_dir: str | os.PathLike, step: int) -> bool:
    at = os.environ.get(EXIT_BEFORE_COMMIT_REPLY_ENV)
    return bool(at) and step >= int(at) and fires_once(run_dir, "exit-before-commit-reply")
