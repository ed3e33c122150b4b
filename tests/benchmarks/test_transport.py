"""benchmarks/transport.py: `hsd bench transport` runs end to end and leaves nothing behind.

The speed targets live in the benchmark's own output, not here: a test box says nothing reliable
about bandwidth.
"""

import json
import math

from common.dataplane.shm_arena import list_segments
from benchmarks.transport import bench_layout
from benchmarks.transport_table import format_table
from benchmarks.transport_timeline import cpus_busy, describe, summarize
from benchmarks.transport_workers import BenchSpec, Meter, percentile
from hsd_testing import assert_session_ended, run_hsd_in_session

REQUIRED_KEYS = ("slot_bytes", "memcpy_gbps", "shm_gbps", "shm_piped_gbps", "memcpy_shared_gbps",
                 "torch_mp_queue_gbps", "zmq_ipc_gbps",
                 "rtt_p50_ms", "rtt_p99_ms", "shm_dispatcher_cpu_ms", "rtt_dispatcher_cpu_us")


def test_bench_transport_json_and_clean_exit():
    run = run_hsd_in_session("bench", "transport", "--slot-mb", "4", "--seconds", "0.5", "--rounds", "2", "--json",
                             timeout=240)  # a shared 2-core host can slow the benchmark a lot
    assert run.returncode == 0, run.stderr[-4000:]
    assert len(run.seen) >= 4, f"expected the benchmark to start its own processes, saw {run.seen}"
    assert "[bench] warning" not in run.stderr, run.stderr[-4000:]

    figures = json.loads(run.stdout)  # exactly one JSON object on stdout
    for key in REQUIRED_KEYS:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert figures["slot_bytes"] == bench_layout(4).slot_bytes
    # Two alternated rounds against one dispatcher, each with its own workers; the ratios are per round.
    assert len(figures["rounds"]) == 2
    for r in figures["rounds"]:
        assert r["shm_gbps"] > 0 and math.isclose(r["shm_vs_memcpy_shared"], r["shm_gbps"] / r["memcpy_shared_gbps"])
    assert min(r["shm_vs_memcpy"] for r in figures["rounds"]) <= figures["shm_vs_memcpy"] \
        <= max(r["shm_vs_memcpy"] for r in figures["rounds"])
    assert "cuda_ipc_gbps" not in figures or figures["cuda_ipc_gbps"] > 0
    timeline = figures["shm_timeline"]  # the per-item timeline of the shm path
    assert timeline["items"] >= 2, timeline
    offsets = timeline["offsets_ms"]
    # Causal order, across processes on one clock: a slot is read only once published and granted.
    assert 0 < offsets["write_end"] <= offsets["published"] <= offsets["reported"], offsets
    assert offsets["published"] <= offsets["granted"] <= offsets["read_start"] < offsets["read_end"], offsets
    assert 0 <= timeline["overlap"] <= 1 and timeline["target_cpu_ms"] > 0 and timeline["drafter_cpu_ms"] > 0
    # where the dispatcher's loop went, per item, and the requests it answered: a drafter's get_hs per item
    assert {"get_hs", "get_job", "poll"} <= set(figures["shm_dispatcher_loop_us_per_item"])
    assert figures["shm_dispatcher_messages_per_item"]["get_hs"] >= 0.9
    table = format_table(figures)  # what the command prints without --json, from the same figures
    assert "memcpy over 6 buffers" in table and "shm arena, real protocol" in table
    assert "reads overlapping a write" in table
    assert "the dispatcher's CPU" in table and "shm / memcpy" in table

    assert_session_ended(run.sid, grace_s=10)  # multiprocessing's resource tracker exits when it sees EOF
    # Other runs on this host may own segments; none may come from a process of the benchmark.
    segments = [s.name for s in list_segments() if s.pid in run.seen]
    assert not segments, f"shared-memory segments left: {segments}"


def test_bench_layout_sizes_the_hidden_states():
    layout = bench_layout(64)
    assert (layout.tokens_per_batch, layout.num_layers, layout.dtype, layout.max_seqs) == (8192, 5, "bfloat16", 1)
    assert abs(layout.hs_bytes - 64 * 2**20) < 8192 * 5 * 2
    assert layout.slot_bytes >= layout.hs_bytes and layout.slot_bytes % 4096 == 0
    assert bench_layout(0.001).hidden_size == 1


def test_meter_counts_only_the_window(monkeypatch):
    clock = iter([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    monkeypatch.setattr("benchmarks.transport_workers.time.perf_counter", lambda: next(clock))
    meter = Meter(BenchSpec(bench_layout(1), seconds=1.5, warmup_s=1.0))
    # 0.0: first item; 0.5: warming up; 1.0: opens the window; 1.5, 2.0, 2.5: counted, then done.
    assert [meter.add(100) for _ in range(6)] == [False] * 5 + [True]
    assert meter.result() == {"gbps": 300 / 1.5 / 1e9, "items": 3, "elapsed_s": 1.5}


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile([3.0], 99) == 3.0


def _stamps(write_ms: tuple[float, float], read_ms: tuple[float, float], cpu_ms: float) -> tuple[dict, dict]:
    ms = 1_000_000
    target = {"target_granted": 0, "write_start": int(write_ms[0] * ms), "write_end": int(write_ms[1] * ms),
              "published": int(write_ms[1] * ms), "reported": int(write_ms[1] * ms), "cpu": int(cpu_ms * ms)}
    drafter = {"granted": int(read_ms[0] * ms), "read_start": int(read_ms[0] * ms), "read_end": int(read_ms[1] * ms),
               "consumed": int(read_ms[1] * ms), "cpu": int(cpu_ms * ms)}
    return target, drafter


def test_timeline_summary_measures_how_the_two_copies_overlap():
    # Item k is written over [10k, 10k + 10) ms and read over [10k + 10, 10k + 20): the write of k + 1
    # runs under the read of k, entirely. Taking turns instead, item k is read in [20k + 10, 20k + 20).
    overlapped = [_stamps((10 * k, 10 * k + 10), (10 * k + 10, 10 * k + 20), 10 * k) for k in range(5)]
    turns = [_stamps((20 * k, 20 * k + 10), (20 * k + 10, 20 * k + 20), 10 * k) for k in range(5)]
    for stamps, overlap, idle in ((overlapped, 0.8, 0.0), (turns, 0.0, 10.0)):
        target = {str(k): t for k, (t, _) in enumerate(stamps)}
        drafter = {str(k): d for k, (_, d) in enumerate(stamps)}
        summary = summarize(target, drafter)
        # the last read overlaps no write: four fifths of the reading time overlap one
        assert summary["overlap"] == overlap and summary["drafter_idle_ms"] == idle
        assert summary["offsets_ms"]["read_start"] == 10 and summary["read_ms"] == summary["write_ms"] == 10
        assert summary["items"] == 5 and summary["target_cpu_ms"] == summary["drafter_cpu_ms"] == 10
        # taking turns, every idle gap waits for the next write
        assert summary["cycle_ms"] == 10 + idle and summary["drafter_idle_mean_ms"] == summary["idle_waiting_for_write_ms"] == idle
        assert cpus_busy(summary, 2.0, 2) == round(22 / (2 * (10 + idle)), 3)
    # Written as when overlapped, but each read starts 2 ms after the previous one ended, though the
    # next item was published before: the gaps are all handoff, none of them waits for the target.
    late = [_stamps((10 * k, 10 * k + 10), (12 * k + 10, 12 * k + 20), 10 * k) for k in range(5)]
    summary = summarize({str(k): t for k, (t, _) in enumerate(late)}, {str(k): d for k, (_, d) in enumerate(late)})
    assert summary["cycle_ms"] == 12 and summary["drafter_idle_mean_ms"] == 2 and summary["idle_waiting_for_write_ms"] == 0
    assert "cycle 12.00, drafter idle 2.00 (0.00 of it before the item was published)" in describe(summary)
    assert summarize({}, {}) == {"items": 0}
