"""A GPU worker's health (CUDA memory, compiled graphs) and any worker's slot copy ms p50/p99, from its
heartbeat to ``hsd stats --json``, its text view and ``/metrics``; GPU figures absent, not zero, for a
worker on the CPU, copy times absent before its first copy.

No GPU here: the memory comes from a fake reader, the device is named ``cuda:0``, and the
heartbeat goes through the real session, wire encoding, dispatcher core and snapshot."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from common.wire import messages
from common.wire.stats_snapshot import AuthView, TransportView, serving_snapshot, to_json_object
from common.worker.gpu_health import CopyTimes, GpuHealthProbe, ReportingSession, percentile
from common.worker.runtime import DispatcherAddress
from core_harness import make_core
from dispatcher.metrics import render_prometheus
from dispatcher.snapshot import build_snapshot
from fake_cuda_runtime import FakeCudaMemory
from ops.stats_view import format_stats

GIB = 2**30


def test_copy_time_quantiles_are_of_the_latest_copies():
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0 and percentile(list(range(1, 101)), 0.99) == 99
    copies = CopyTimes(window=100)
    assert copies.quantiles() is None
    for ms in [100.0] * 50 + [1.0] * 98 + [40.0] * 2:  # the first 50 slid out of the window
        copies.add(ms / 1e3)
    assert copies.count == 150 and copies.quantiles() == (1.0, 40.0)
    assert CopyTimes().read() is None
    assert copies.read() == messages.SlotCopies(copies=150, copy_ms_p50=1.0, copy_ms_p99=40.0)


def test_a_worker_on_the_cpu_reports_no_gpu_health():
    memory = FakeCudaMemory(allocated=GIB, reserved=2 * GIB, peak=3 * GIB)
    assert GpuHealthProbe("cpu", memory).read() is None and memory.devices == []
    reading = GpuHealthProbe("cuda:0", memory).read()
    assert reading.memory_reserved_bytes == 2 * GIB and reading.compiled_graphs >= 0
    assert memory.devices == ["cuda:0"] * 3


def test_gpu_health_reaches_stats_json_the_text_view_and_metrics(tmp_path):
    core = make_core(tmp_path)
    target = core.register(role="target", name="target-0", pid=11, host="h", gpu=0, now=0.0).id
    drafter = core.register(role="drafter", name="drafter-0", pid=12, host="h", gpu=None, now=0.0).id
    copies = {target: CopyTimes(), drafter: CopyTimes()}
    for ms in (2.0, 2.5, 3.0, 9.0):
        copies[target].add(ms / 1e3)
    copies[drafter].add(0.004)  # a worker on the CPU reports its copies too
    memory = FakeCudaMemory(allocated=5 * GIB, reserved=6 * GIB, peak=7 * GIB)
    sessions = {}
    for worker_id, device in ((target, "cuda:0"), (drafter, "cpu")):
        session = ReportingSession(DispatcherAddress(endpoint=f"ipc://{tmp_path}/none.sock"), "target", worker_id)
        session.worker_id, session.token = worker_id, "t"
        session.health = GpuHealthProbe(device, memory).read
        session.copies = copies[worker_id]
        sessions[worker_id] = session
    try:
        for worker_id, session in sessions.items():
            beat = messages.decode_request(messages.encode(session._heartbeat()))  # as the dispatcher reads it
            core.heartbeat(worker_id, 1.0, beat.holding, beat.seen_grant, gpu=beat.gpu, copies=beat.copies)
    finally:
        for session in sessions.values():
            session.close()
    snapshot = serving_snapshot(build_snapshot(core, 2.0), run_dir=str(tmp_path), run_id="r", pid=1,
                                transport=TransportView(kind="shm", num_slots=6, slot_bytes=1000, pool_bytes=6000,
                                                        per_target=False),
                                waiters=0, auth=AuthView(mechanism="none"), nodes={})

    workers = {w["name"]: w for w in to_json_object(snapshot)["workers"]}  # hsd stats --json
    assert workers["target-0"]["gpu_health"] == {
        "memory_allocated_bytes": 5 * GIB, "memory_reserved_bytes": 6 * GIB, "memory_peak_bytes": 7 * GIB,
        "compiled_graphs": workers["target-0"]["gpu_health"]["compiled_graphs"]}
    assert workers["target-0"]["slot_copies"] == {"copies": 4, "copy_ms_p50": 2.5, "copy_ms_p99": 9.0}
    assert "gpu_health" not in workers["drafter-0"]  # absent, not zero
    assert workers["drafter-0"]["slot_copies"] == {"copies": 1, "copy_ms_p50": 4.0, "copy_ms_p99": 4.0}

    text = format_stats(snapshot)
    assert "target-0     gpu: allocated 5.00 GiB  reserved 6.00 GiB  peak 7.00 GiB  copy p50 2.50 ms p99 9.00 ms " \
           "(4 slots)" in text and "drafter-0    gpu:" not in text
    assert "drafter-0    slots: copy p50 4.00 ms p99 4.00 ms (1 slots)" in text

    families = {f.name: f for f in text_string_to_metric_families(render_prometheus(snapshot))}
    for name, value in (("hsd_worker_gpu_memory_allocated_bytes", 5 * GIB),
                        ("hsd_worker_gpu_memory_reserved_bytes", 6 * GIB),
                        ("hsd_worker_gpu_memory_peak_bytes", 7 * GIB)):
        assert [(s.labels["worker"], s.value) for s in families[name].samples] == [("target-0", value)]
    copy_ms = {(s.labels["worker"], s.labels["quantile"]): s.value for s in families["hsd_worker_slot_copy_ms"].samples}
    assert copy_ms == {("target-0", "0.5"): 2.5, ("target-0", "0.99"): 9.0, ("drafter-0", "0.5"): 4.0,
                       ("drafter-0", "0.99"): 4.0}
    assert {s.labels["worker"]: s.value for s in families["hsd_worker_slot_copies"].samples} == {
        "target-0": 4, "drafter-0": 1}
    assert [s.labels["worker"] for s in families["hsd_worker_compiled_graphs"].samples] == ["target-0"]
