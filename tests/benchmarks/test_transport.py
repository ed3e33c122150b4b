"""benchmarks/transport.py: `hsd bench transport` runs end to end and leaves nothing behind.

The speed targets live in the benchmark's own output, not here: a test box says nothing reliable
about bandwidth.
"""

import json
import math

from common.dataplane.shm_arena import list_segments
from benchmarks.transport import bench_layout
from benchmarks.transport_table import format_table
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
    table = format_table(figures)  # what the command prints without --json, from the same figures
    assert "memcpy over 6 buffers" in table and "shm arena, real protocol" in table
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
