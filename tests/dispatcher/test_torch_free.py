"""The dispatcher never imports torch on shm (it costs seconds at start and a GB of address space),
nor do the ``hsd`` command line and the operator's tools (ops/) at import: a subcommand loads torch
only when it runs a worker, a benchmark or the demo.

The witness is the running process itself: a module torch loads (its C extension, libtorch) would
show up in the dispatcher's memory maps.
"""

from __future__ import annotations

import glob
import signal
import subprocess
import sys

import psutil
import pytest

from common.wire.client import run_id_for
from common.dataplane.shm_segment import list_segments
from hsd_testing import kill_tree, start_hsd, stats, wait_for


def _torch_libraries(pid: int) -> list[str]:
    return sorted({m.path for m in psutil.Process(pid).memory_maps() if "torch" in m.path.lower()})


def test_importing_the_dispatcher_and_cli_leaves_torch_out():
    code = ("import sys, dispatcher.build, dispatcher.transport_setup, common.dataplane.shm_segment, common.dataplane.transport_info, "
            "common.run.slot_layout, hsd.cli, hsd.bench, hsd.shared, ops.launch, ops.stats_view, ops.report, ops.planner, "
            "ops.schedule_view, ops.demo, ops.configs; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_running_shm_dispatcher_maps_no_torch(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_hsd("dispatcher", f"run.dir={run_dir}", "pool.transport=shm", "data.synthetic_samples=50",
                     log_path=tmp_path / "dispatcher.log")
    try:
        snapshot = wait_for(lambda: stats(run_dir), 60, what="the dispatcher to answer stats")
        assert snapshot["transport"]["kind"] == "shm"
        assert _torch_libraries(proc.pid) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "dispatcher.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    assert not list_segments(run_id_for(run_dir)), "the dispatcher must unlink its pool on exit"


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="this host has NVIDIA devices")
def test_auto_transport_without_nvidia_devices_resolves_to_shm_without_torch():
    code = ("import sys; from common.dataplane.transport_info import resolve_transport; "
            "print(resolve_transport('auto', True), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["shm", "False"]
