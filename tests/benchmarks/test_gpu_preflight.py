"""hsd bench gpu's preflight, its plan and its hard deadlines, on the CPU.

The preflight is written before anything else, whatever the image lacks (a module hidden from the
path here); each section runs in a process of its own, killed at its deadline; SIGTERM keeps what
finished and stops every process the check started (a CPU stand-in section that launches processes
in a session of their own, switched on by ``HSD_TEST_FAULTS=bench_gpu_stand_in=SECONDS``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.gpu import BUDGET_S, SECTION_NAMES, SECTIONS, plan
from benchmarks.gpu_preflight import NO_CUDA, Needs, needs_of, unmet
from hsd_testing import hsd

NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}  # the same answer on a GPU host


def _facts(*, gpus: int = 1, missing: tuple[str, ...] = (), compiler: bool = True, shm_mib: float = 8192.0) -> dict:
    names = ("torch", "transformers", "numpy", "safetensors", "tokenizers", "tqdm", "yaml", "zmq", "msgspec",
             "msgpack", "psutil", "prometheus_client", "pytest")
    return {"cuda": {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}] * gpus},
            "modules": {n: {"found": False, "error": "ModuleNotFoundError: no"} if n in missing else {"found": True}
                        for n in names},
            "compiler": {"ok": compiler, "problem": None if compiler else "no C compiler (cc, gcc, clang) on PATH"},
            "shm": {"total_mib": shm_mib}}


def test_a_section_whose_needs_are_missing_is_skipped_with_the_reason():
    assert unmet(needs_of("launch"), _facts()) is None
    assert unmet(needs_of("launch"), _facts(gpus=0)) == NO_CUDA
    assert unmet(needs_of("nccl_group"), _facts()) == "needs 2 GPUs, this host has 1"
    assert unmet(needs_of("nccl_group"), _facts(gpus=2)) is None
    reason = unmet(needs_of("launch"), _facts(missing=("prometheus_client", "psutil")))
    assert reason.startswith("missing modules psutil, prometheus_client (psutil: ModuleNotFoundError") and \
        "make gpu-wheels" in reason
    assert unmet(needs_of("nccl_init"), _facts(missing=("msgspec",))) is None  # torch alone
    assert "C compiler" in unmet(needs_of("dflash_step"), _facts(compiler=False))
    assert unmet(needs_of("capture"), _facts(compiler=False)) is None
    assert "/dev/shm holds 64 MiB" in unmet(needs_of("pinned_shm"), _facts(shm_mib=64))
    assert unmet(needs_of("a_new_section"), _facts(missing=("zmq",))).startswith("missing modules zmq")
    assert unmet(Needs(modules=(), gpus=0), _facts(gpus=0)) is None


def test_the_mfu_peak_of_a_pcie_part_is_its_own():
    from benchmarks.gpu_sections import peak_bf16_tflops
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0 and peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA H100 NVL") == 835.0 and peak_bf16_tflops("Tesla T4") is None


def test_the_plan_fits_the_budget_whatever_each_section_takes():
    one_gpu = [s for s in SECTIONS if needs_of(s[0]).gpus < 2]
    p = plan(one_gpu, BUDGET_S - 30.0)  # the preflight's worst case first
    assert p["worst_case_s"] <= BUDGET_S - 30.0 and p["planned"][:4] == SECTION_NAMES[:4]
    assert p["planned"] + p["if_time_is_left"] == [s[0] for s in one_gpu]
    assert plan(SECTIONS, 10.0) == {"budget_s": 10.0, "planned": [], "worst_case_s": 0.0,
                                    "if_time_is_left": SECTION_NAMES}


def test_the_preflight_is_written_when_msgspec_and_pyzmq_cannot_be_imported(tmp_path):
    hidden = tmp_path / "hidden"
    for name in ("msgspec", "zmq"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed in this image')\n")
    env = {**os.environ, **NO_GPU_ENV, "PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", ""),
                                                                      os.getcwd()])}
    out = tmp_path / "out"
    started = time.monotonic()
    hsd("bench", "gpu", "--out", str(out), env=env, timeout=60)  # exit 0
    assert time.monotonic() - started < 60
    facts = json.loads((out / "00-preflight.json").read_text())
    assert facts["missing"] == ["zmq", "msgspec"]
    assert facts["modules"]["msgspec"] == {"found": False, "error": "ImportError: msgspec is not installed in this image"}
    assert facts["modules"]["torch"]["found"] and facts["python"]["executable"] == sys.executable
    assert {"cc", "python_h", "ok"} <= set(facts["compiler"]) and facts["shm"]["total_mib"] > 0
    assert facts["cuda"]["cuda"] is False and facts["versions"]["torch"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["00-preflight.json"] + [f"{n:02d}-{name}.json" for n, name in enumerate(SECTION_NAMES, 1)]
    assert all(json.loads((out / f).read_text())["skipped"] == NO_CUDA for f in files[1:])


def _start_check(tmp_path, deadline_s: float, *args: str) -> tuple[subprocess.Popen, object]:
    env = {**os.environ, **NO_GPU_ENV, "HSD_TEST_FAULTS": f"bench_gpu_stand_in={deadline_s}"}
    log = open(tmp_path / "check.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hsd.cli", "bench", "gpu", "--out", str(tmp_path / "out"), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log


def _launched_pids(tmp_path, proc: subprocess.Popen, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"stand_in launched pids (\d+) (\d+)", (tmp_path / "check.log").read_text())
        if found:
            return [int(found[1]), int(found[2])]
        time.sleep(0.05)
    raise AssertionError(f"the stand-in never launched: {(tmp_path / 'check.log').read_text()[-2000:]}")


def _gone(pids: list[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return not alive


def _stop(proc: subprocess.Popen, pids: list[int]) -> None:
    """Whatever the check left running (only when the test already failed)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(120)
def test_sigterm_keeps_what_finished_marks_the_running_section_and_stops_what_it_launched(tmp_path):
    proc, log = _start_check(tmp_path, 60.0, "--only", "nccl_init")
    pids: list[int] = []
    try:
        pids = _launched_pids(tmp_path, proc)
        assert not _gone(pids) and os.getpgid(pids[0]) != os.getpgid(proc.pid)  # a session of its own
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        gone = _gone(pids)
    finally:
        _stop(proc, pids)
        log.close()
    out = tmp_path / "out"
    assert json.loads((out / "00-preflight.json").read_text())["cuda"]["cuda"] is False
    interrupted = json.loads((out / "stand_in.json").read_text())
    assert interrupted["interrupted"].startswith("SIGTERM after") and "stopped" in interrupted["interrupted"]
    assert json.loads((out / "04-nccl_init.json").read_text())["skipped"] == "the check was interrupted (SIGTERM) " \
                                                                            "before it"
    assert gone, "a process the stand-in launched outlived the check"


@pytest.mark.timeout(120)
def test_a_section_past_its_deadline_is_killed_with_what_it_launched_and_the_next_ones_run(tmp_path):
    proc, log = _start_check(tmp_path, 10.0, "--only", "nccl_init", "--json")  # its process starts well within it
    pids: list[int] = []
    try:
        pids = _launched_pids(tmp_path, proc)
        assert proc.wait(timeout=60) == 1  # the stand-in failed: it timed out
        gone = _gone(pids)
    finally:
        _stop(proc, pids)
        log.close()
    out = tmp_path / "out"
    timed_out = json.loads((out / "stand_in.json").read_text())
    assert timed_out["timed_out"] is True and "its 10s deadline" in timed_out["error"] and timed_out["seconds"] < 30
    assert json.loads((out / "04-nccl_init.json").read_text())["skipped"] == NO_CUDA
    assert gone
