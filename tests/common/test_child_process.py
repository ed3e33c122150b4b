"""die_with_parent: a child started with it is killed when the process that started it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

# The parent starts one child that would sleep for a minute, prints the child's pid and waits.
PARENT = """
import subprocess, sys, time
from common.child_process import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=die_with_parent if sys.argv[1] == "yes" else None)
print(child.pid, flush=True)
time.sleep(60)
"""


def _orphan(tmp_path, with_it: str) -> psutil.Process:
    """Start the parent, read its child's pid, SIGKILL the parent; returns the child."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, with_it], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, cwd=tmp_path)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    return child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent_and_only_when_asked(tmp_path):
    child = _orphan(tmp_path, "yes")
    child.wait(timeout=30)  # raises TimeoutExpired if it outlived its parent
    survivor = _orphan(tmp_path, "no")
    try:
        with pytest.raises(psutil.TimeoutExpired):
            survivor.wait(timeout=1)  # without it the child lives on: the test above can fail
    finally:
        survivor.send_signal(signal.SIGKILL)
        survivor.wait(timeout=30)
