"""`hsd bench scale`: a tiny sweep end to end (a real dispatcher process, client processes of many
simulated workers), and the arithmetic of its figures. The figures themselves live in the bench's
output: a shared test box says nothing reliable about CPU per item."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.scale import json_safe
from benchmarks.scale_model import GpuModel, gpus_served_in_time, parse_loads, parse_workers, step_figures
from benchmarks.scale_table import format_step, table_header
from common.dataplane.shm_segment import list_segments
from hsd_testing import assert_session_ended, hsd, run_hsd_in_session

def _refuse(constant: str):
    raise ValueError(f"{constant} in the JSON output")


STEP_KEYS = ("items_per_s", "offered_items_per_s", "dispatcher_cpu_us_per_item", "loop_thread_cpu_us_per_item",
             "projected_gpus_per_core", "request_p50_ms", "request_p99_ms", "request_max_ms", "heartbeat_lag_p99_ms",
             "journal_bytes_per_s", "client_cpu_pct", "messages_per_item", "steal_pct", "other_cpu_pct")


def test_a_tiny_sweep_runs_every_step_exactly_once_and_leaves_nothing(tmp_path):
    run = run_hsd_in_session("bench", "scale", "--workers", "4,16", "--load", "1,2", "--seconds", "2", "--warmup",
                             "0.5", "--json", "--dir", str(tmp_path), timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "warning" not in run.stderr, run.stderr[-4000:]
    result = json.loads(run.stdout, parse_constant=_refuse)  # one JSON object on stdout, strict (no NaN)
    assert result["model"]["tokens_per_s"] == 27_000 and result["model"]["job_tokens"] == 16_384
    steps = result["steps"]
    assert [(s["workers"], s["targets"] + s["drafters"], s["load"]) for s in steps] == \
        [(4, 4, 1), (4, 4, 2), (16, 16, 1), (16, 16, 2)]
    for s in steps:  # at load 2 a worker's jobs come twice as fast, and its heartbeats are due twice as often
        assert s["offered_items_per_s"] == pytest.approx(s["targets"] * s["load"] * 27_000 / 16_384)
        assert s["heartbeat_s"] == pytest.approx(0.5 / s["load"])
    for s in steps:
        for key in STEP_KEYS:
            assert s[key] is not None, (s["workers"], key)
        assert s["registered"] == s["workers"] and s["lost_workers"] == 0
        if s["thread_cpu_us_per_item"]:  # where the kernel keeps each thread's schedstat: the loop is among them
            assert s["thread_cpu_us_per_item"]["loop"] > 0
        assert s["items"] > 0
        # the loop's CPU by what it went to: every op the workers sent, and the poller's wake-ups
        assert {"get_job", "get_hs", "poll"} <= set(s["loop_cpu_us_per_item"]), s["loop_cpu_us_per_item"]
        assert all(us >= 0 for us in s["loop_cpu_us_per_item"].values())
        assert s["loop_cpu_us_per_request"]["get_job"] > 0
        assert s["loop_wakeups_per_item"] > 0 and s["loop_cpu_us_per_wakeup"] > 0
        assert s["duplicates"] == 0, "a job was committed twice"
        assert s["errors"] == {} and s["given_back"] == {}, (s["errors"], s.get("error_examples"))
        # a target reports a job ready on its next get_job unless one is in flight as the job ends
        assert s["messages_per_item"].get("job_ready", 0) < 1.0 and s["messages_per_item"]["get_hs"] > 0
        assert s["requests_timed"] > 0 and s["request_p50_ms"] <= s["request_p99_ms"] <= s["request_max_ms"]
        assert len(s["client_cpu_pct"]) == 2 and s["journal_bytes_per_s"] > 0
        assert s["dispatcher_exit_code"] == 0 and s["shm_left"] == 0
        # the socket floor: a bare echo answered the step's connections at about its request rate
        assert s["floor_connections"] == s["workers"] and s["floor_requests_per_s"] > 0
        if s["thread_cpu_us_per_item"]:  # each thread's schedstat is kept: the echo's threads are timed too
            assert s["floor_cpu_us_per_request"] >= s["floor_loop_us_per_request"] > 0
        assert s["floor_requests_per_wakeup"] > 0
        assert s["requests_per_item"] == pytest.approx(sum(s["messages_per_item"].values()))
        assert s["floor_cpu_us_per_item"] == pytest.approx(s["floor_cpu_us_per_request"] * s["requests_per_item"])
        assert s["over_floor"] == pytest.approx(s["dispatcher_cpu_us_per_request"] / s["floor_cpu_us_per_request"])
    assert sum(s["committed"] for s in steps) > 0  # a drafter commits every 4 micro-batches
    in_time = result["gpus_served_within_p99_ms"]
    assert in_time["p99_ms"] == 10 and (in_time["gpus"] is None or in_time["gpus"] == max(
        s["gpus_served"] for s in steps if s["request_p99_ms"] <= 10))
    assert_session_ended(run.sid, grace_s=10)
    segments = [seg.name for seg in list_segments() if seg.pid in run.seen]
    assert not segments, f"shared-memory segments left: {segments}"
    assert not any(tmp_path.iterdir()), "the run directories were not removed"


def test_bad_sweep_is_refused_with_exit_2():
    proc = hsd("bench", "scale", "--workers", "16,1", check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--workers" in proc.stderr
    proc = hsd("bench", "scale", "--workers", "16", "--load", "0", check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--load" in proc.stderr
    proc = hsd("bench", "scale", "--workers", "16", "--drafter-fraction", "0", check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--drafter-fraction" in proc.stderr


def test_the_gpu_model_splits_workers_into_as_few_drafters_as_keep_up():
    model = GpuModel()
    assert model.target_jobs_per_s == pytest.approx(27_000 / 16_384)
    for workers in (2, 4, 16, 64, 256, 1024, 3000):
        targets, drafters = model.split(workers)
        assert targets + drafters == workers and targets >= 1 and drafters >= 1
        if workers >= 16:  # with a quarter to spare, and a drafter fewer would not have it
            assert drafters * model.drafter_batches_per_s >= 1.25 * targets * model.target_jobs_per_s
            assert (drafters - 1) * model.drafter_batches_per_s < 1.25 * (targets + 1) * model.target_jobs_per_s
    assert model.split(1024) == (725, 299)
    assert model.split(1024, 0.7) == (815, 209) and model.split(1024, 2.0) == (426, 598)  # drafter-bound, then spare
    assert model.split(2, 0.1) == (1, 1) and model.split(4, 100.0) == (1, 3)  # one of each, always
    with pytest.raises(ValueError, match="job_tokens"):
        GpuModel(job_tokens=0)


def test_one_core_projects_to_gpus_at_the_stated_model():
    model = GpuModel()
    assert model.gpus_per_core(1.55e-3) == pytest.approx(391, abs=1)  # today's transport-bench figure
    assert model.gpus_per_core(150e-6) >= 3000  # the CPU per item that serves 3,000 GPUs from one core
    assert GpuModel(job_tokens=4096).gpus_per_core(1.55e-3) == pytest.approx(98, abs=1)


def test_a_load_multiplies_the_rates_and_gpus_are_counted_in_the_stated_models():
    model = GpuModel()
    fast = model.scaled(4)
    assert fast.target_jobs_per_s == pytest.approx(4 * model.target_jobs_per_s)
    assert fast.drafter_batches_per_s == 20 and fast.job_tokens == model.job_tokens
    assert fast.split(1024) == model.split(1024)  # the same targets and drafters, each sending four times as much
    figures = step_figures(
        model=model, load=4, targets=10, drafters=5, window_s=1.0, dispatcher_cpu_s=0.01, loop_thread_cpu_s=0.008,
        items=66, requests={"get_job": 66}, given_back={}, journal_bytes=0, latencies_ms={}, heartbeat_lag_ms=[],
        heartbeat_age_max_s=0.0, client_cpu_s=[0.1], host={"steal_pct": 0.0, "other_cpu_pct": 0.0}, committed=0,
        duplicates=0, errors={}, late_wakeups=0)
    assert figures["offered_items_per_s"] == pytest.approx(40 * model.target_jobs_per_s)
    assert figures["gpus_served"] == pytest.approx(66 / model.target_jobs_per_s)
    assert figures["projected_gpus_per_core"] == pytest.approx(model.gpus_per_core(0.01 / 66))
    row = format_step(figures)
    assert "10+5x4" in row and "the traffic of 40 target GPUs" in row
    assert parse_loads("1, 2.5,4") == [1.0, 2.5, 4.0]
    in_time, late = {**figures, "request_p99_ms": 4.0}, {**figures, "gpus_served": 90.0, "request_p99_ms": 250.0}
    assert gpus_served_in_time([in_time, late]) == figures["gpus_served"]
    assert gpus_served_in_time([late, figures]) is None  # too late, or not timed at all
    for bad in ("", "x", "0", "1,-2", "nan"):
        with pytest.raises(ValueError, match="--load"):
            parse_loads(bad)


def test_parse_workers():
    assert parse_workers("16,64, 256") == [16, 64, 256]
    for bad in ("", "a,b", "1,16"):
        with pytest.raises(ValueError, match="--workers"):
            parse_workers(bad)


def test_step_figures_and_the_table_row():
    figures = step_figures(
        model=GpuModel(), targets=3, drafters=1, window_s=2.0, dispatcher_cpu_s=0.02, loop_thread_cpu_s=0.015,
        items=10, requests={"job_ready": 2, "get_job": 10, "get_hs": 11, "heartbeat": 16, "commit_step": 2},
        given_back={}, journal_bytes=4000, latencies_ms={"get_job": [1.0, 2.0], "heartbeat": [0.5], "get_hs": [90.0]},
        heartbeat_lag_ms=[3.0, 1.0], heartbeat_age_max_s=0.4, client_cpu_s=[0.1, 1.9],
        host={"steal_pct": 0.0, "other_cpu_pct": 5.0}, committed=8, duplicates=0, errors={}, late_wakeups=0)
    assert figures["items_per_s"] == 5.0 and figures["dispatcher_cpu_us_per_item"] == pytest.approx(2000)
    assert figures["loop_thread_cpu_us_per_item"] == pytest.approx(1500)
    assert figures["projected_gpus_per_core"] == pytest.approx(1 / 2e-3 / (27_000 / 16_384))
    assert figures["messages_per_item"]["heartbeat"] == 1.6
    # get_hs waits for a ready slot by design: it is not among the requests timed
    assert (figures["request_p50_ms"], figures["request_max_ms"], figures["requests_timed"]) == (1.0, 2.0, 3)
    assert figures["client_cpu_pct"] == [5.0, 95.0] and figures["client_saturated"]
    assert figures["journal_bytes_per_item"] == 400
    row = format_step(figures)
    assert "3+1" in row and "saturated" in row and "socket floor" not in row  # a step run without the floor
    floor = {"floor_connections": 4, "floor_requests_per_s": 20.5, "floor_cpu_us_per_request": 60.0,
             "floor_loop_us_per_request": 35.0, "floor_io_us_per_request": 25.0, "floor_requests_per_wakeup": 1.5,
             "requests_per_item": 4.1, "dispatcher_cpu_us_per_request": 240.0, "floor_cpu_us_per_item": 246.0,
             "over_floor": 4.0}
    assert ("socket floor (a bare echo, 4 connections at 20 requests/s): 60 us a request (loop 35, I/O 25), "
            "1.50 requests a wake-up; x 4.10 requests an item = 246 us an item; the dispatcher 240 us a request, "
            "4.0x the floor") in format_step({**figures, **floor})
    assert "27,000 tokens/s" in table_header(GpuModel())
    empty = step_figures(
        model=GpuModel(), targets=1, drafters=1, window_s=1.0, dispatcher_cpu_s=0.01, loop_thread_cpu_s=0.01,
        items=0, requests={}, given_back={}, journal_bytes=0, latencies_ms={}, heartbeat_lag_ms=[], heartbeat_age_max_s=0.0,
        client_cpu_s=[0.0], host={"steal_pct": 0.0, "other_cpu_pct": 0.0}, committed=0, duplicates=0, errors={},
        late_wakeups=0)
    assert math.isnan(empty["dispatcher_cpu_us_per_item"]) and json_safe(empty)["projected_gpus_per_core"] is None
    assert "nan" not in format_step(empty)
