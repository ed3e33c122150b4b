"""hsd bench gpu: what it does without CUDA, and its sections' logic on the CPU at tiny shapes.

The figures themselves only mean something on a GPU; here the sections run in their reduced form
(no pinned pages, no overlap, no peak memory or MFU, ``shm`` only for the launch) so that their
code paths, the report they read and the witness they check are exercised on every CI run.
"""

from __future__ import annotations

import json
import os
import tarfile
import time

import pytest
import torch

from benchmarks.gpu import SECTION_NAMES, SECTIONS, Output, format_check, run_check, run_sections
from benchmarks.gpu_checks import auto_choice, flex_recompiles, nccl_init, pin_refusal
from benchmarks.gpu_launch import launch, target_restart
from benchmarks.gpu_sections import TINY, CheckContext, Skip, capture, dflash_step, ipc_handoff, pinned_shm
from common.dataplane.shm_arena import list_segments
from hsd_testing import hsd

CPU = torch.device("cpu")


def test_without_cuda_every_section_writes_skipped_and_it_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the same answer on a GPU host
    out, bundle = tmp_path / "out", tmp_path / "bundle"
    as_json = json.loads(hsd("bench", "gpu", "--json", "--out", str(out), "--bundle", str(bundle), env=env,
                             timeout=120).stdout)  # exit 0, one JSON object
    assert as_json["cuda"] is False and "no CUDA device" in as_json["message"] and as_json["failed"] == []
    assert as_json["sections"] == {name: {"skipped": "no CUDA"} for name in SECTION_NAMES}
    assert format_check(as_json) == f"hsd bench gpu: {as_json['message']}" and "nothing measured" in as_json["message"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["00-preflight.json"] + [f"{n:02d}-{name}.json" for n, name in enumerate(SECTION_NAMES, 1)]
    for number, name in enumerate(SECTION_NAMES, 1):
        assert json.loads((out / f"{number:02d}-{name}.json").read_text()) == {"section": name, "skipped": "no CUDA"}
    assert sorted(p.name for p in bundle.iterdir()) == ["bench-gpu.json", "bench-gpu.tar.gz"]
    assert json.loads((bundle / "bench-gpu.json").read_text())["sections"] == as_json["sections"]
    assert as_json["preflight"] == json.loads((out / "00-preflight.json").read_text())
    with tarfile.open(bundle / "bench-gpu.tar.gz") as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == [f"bench-gpu/{f}" for f in files]
    with pytest.raises(ValueError, match="warp_drive.*the sections are cuda_ipc_tests"):
        run_check(only=["capture", "warp_drive"])


def test_a_section_writes_its_file_when_it_ends_and_a_failed_one_keeps_its_logs(tmp_path):
    ctx = CheckContext(device=CPU, tmp=tmp_path / "tmp", shapes=TINY, deadline=time.monotonic() + 600)
    ctx.tmp.mkdir()
    seen = []

    def failing(ctx):
        (ctx.tmp / "worker.log").write_text("the worker's last words\n")
        raise RuntimeError("it broke")

    def second(ctx):
        seen.append(sorted(p.name for p in (tmp_path / "out").iterdir()))  # the first one's files are there
        raise Skip("needs two GPUs, this host has 1")
    output = Output(tmp_path / "out", None, {"cuda": False})
    results = run_sections([("launch", failing, 0.0), ("nccl_group", second, 0.0)], ctx, output)
    assert results["launch"]["error"] == "RuntimeError: it broke"
    assert results["nccl_group"]["skipped"] == "needs two GPUs, this host has 1"
    launch = f"{SECTION_NAMES.index('launch') + 1:02d}-launch"
    assert seen == [[launch + "-logs", launch + ".json"]]
    assert (tmp_path / "out" / f"{launch}-logs" / "00-worker.log").read_text() == "the worker's last words\n"


def test_a_failing_section_reports_its_error_and_the_others_run(tmp_path):
    ctx = CheckContext(device=CPU, tmp=tmp_path, shapes=TINY, deadline=time.monotonic() + 600)
    sections = [("ipc_handoff", ipc_handoff, 0.0), ("pinned_shm", pinned_shm, 0.0),
                ("over_budget", pinned_shm, 601.0)]
    results = run_sections(sections, ctx)
    assert results["ipc_handoff"]["error"] == "RuntimeError: needs CUDA"
    shm = results["pinned_shm"]
    assert "error" not in shm and shm["pinned"] is False and shm["slot_bytes"] > 0
    assert all(shm[k] > 0 for k in ("shm_write_gbps", "shm_read_gbps", "plain_d2h_gbps", "plain_h2d_gbps"))
    assert "copy_overlap" not in shm  # a CUDA figure
    assert "skipped" in results["over_budget"] and "budget" in results["over_budget"]["skipped"]
    assert [name for name, _, _ in SECTIONS][:6] == ["cuda_ipc_tests", "pin_refusal", "auto_choice", "nccl_init",
                                                     "ipc_handoff", "pinned_shm"]
    assert not [s for s in list_segments() if s.pid == os.getpid()], "the pinned_shm pool was left in /dev/shm"


def test_capture_and_dflash_sections_at_tiny_shapes(tmp_path):
    ctx = CheckContext(device=CPU, tmp=tmp_path, shapes=TINY)
    figures = capture(ctx)
    assert sorted(figures["buckets"], key=int) == [str(b) for b in TINY.buckets]
    assert all(row["capture_tok_s"] > 0 and row["plain_tok_s"] > 0 for row in figures["buckets"].values())
    step = dflash_step(ctx)
    assert step["attention"] == "sdpa" and step["tok_s"] > 0 and step["blocks"] > 0
    assert step["tflops_per_step"] >= 0 and "mfu" not in step and "peak_gib" not in step


@pytest.mark.timeout(300)
def test_launch_section_runs_exactly_once_on_the_cpu_with_shm(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = CheckContext(device=CPU, tmp=tmp_path, shapes=TINY, deadline=time.monotonic() + 240)
    figures = launch(ctx)
    assert set(figures) == {"shm", "witness_ok"}
    run = figures["shm"]
    assert run["exit_code"] == 0 and run["exactly_once"] and figures["witness_ok"]
    assert (run["witness_duplicates"], run["witness_missing"]) == (0, 0) and run["committed"] == run["jobs_total"] > 0
    assert run["drafter_tokens_per_s"] > 0



def test_the_cuda_only_sections_skip_on_the_cpu(tmp_path):
    ctx = CheckContext(device=CPU, tmp=tmp_path, shapes=TINY)
    for section in (pin_refusal, auto_choice, nccl_init, flex_recompiles, target_restart):
        with pytest.raises(Skip, match="no CUDA"):
            section(ctx)
