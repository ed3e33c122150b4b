"""The run_dir fixture: after each end-to-end test, nothing of the run may be left behind."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from common.wire.client import run_id_for
from common.dataplane.shm_arena import list_segments


@pytest.fixture
def run_dir(tmp_path):
    """A run directory; after the test, no process of the run and no shm segment of it may be left."""
    path = tmp_path / "run"
    yield path
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if p.info["cmdline"] and str(path) in " ".join(p.info["cmdline"])]
    for p in leftovers:
        p.kill()
    segments = list_segments(run_id_for(path))
    for segment in segments:
        Path(segment.path).unlink(missing_ok=True)
    assert not leftovers, f"processes left running: {[p.pid for p in leftovers]}"
    assert not segments, f"shared-memory segments left: {segments}"
