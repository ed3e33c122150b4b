"""The Prometheus collector over hand-made snapshots, and the HTTP server in this process."""

from __future__ import annotations

import copy
import urllib.request

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from common.wire.stats_snapshot import Snapshot
from core_harness import make_core
from dispatcher.metrics import MetricsServer, render_prometheus
from dispatcher.snapshot import build_snapshot

SNAPSHOT = msgspec.convert({
    "run_dir": "runs/x", "run_id": "r", "pid": 42, "waiters": 0, "auth": {"mechanism": "none"}, "nodes": {}, "pool_peak_slots": 8,
    "models": {}, "groups": {},
    "time": 1000.0, "uptime_s": 12.5, "done": False, "epochs_total": 2, "steps": 7,
    "epochs": [{"epoch": 0, "jobs": 40, "committed": 28, "taken": 33,
                "schedule_prefix_deviation": 1.1, "consumed_prefix_deviation": 1.7}],
    "jobs_by_state": {"pending": 3, "extracting": 2, "ready": 4, "training": 2, "consumed": 1, "committed": 28},
    "q_hsb": {"128": 1, "4096": 3},
    "pool": {"free": 8, "writing": 2, "ready": 4, "reading": 2},
    "transport": {"kind": "shm", "slot_bytes": 1000, "num_slots": 16, "pool_bytes": 16000, "per_target": False},
    "workers": [
        {"id": "w1", "name": "target-0", "role": "target", "pid": 1, "host": "h", "gpu": None, "state": "busy",
         "jobs": 20, "tokens_per_s": 5000.0, "idle_ratio": 0.1, "heartbeat_age_s": 0.2, "alive_s": 12.0, "wait_s": 1.2,
         "held": []},
        {"id": "w2", "name": "drafter-0", "role": "drafter", "pid": 2, "host": "h", "gpu": None, "state": "starved",
         "jobs": 28, "tokens_per_s": 4000.0, "idle_ratio": 0.4, "heartbeat_age_s": 0.1, "alive_s": 12.0, "wait_s": 4.8,
         "held": []}],
    "requests": {"register": 2, "get_job": 30, "get_hs": 40},
    "errors": {"bad_message": 1},
    "given_back": {"dead": 2, "lease_expired": 1},
}, Snapshot)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family, **labels) -> float:
    matches = [s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (family.name, labels, family.samples)
    return matches[0]


def test_every_figure_of_the_snapshot_is_exposed():
    f = families(render_prometheus(SNAPSHOT))
    assert value(f["hsd_jobs"], state="committed") == 28
    assert value(f["hsd_ready_slots"], bucket="4096") == 3
    assert f["hsd_steps"].type == "counter" and f["hsd_steps"].samples[0].name == "hsd_steps_total"
    assert f["hsd_steps"].samples[0].value == 7
    assert value(f["hsd_worker_tokens_per_second"], worker="target-0", role="target") == 5000
    assert value(f["hsd_worker_idle_ratio"], worker="drafter-0") == 0.4
    assert value(f["hsd_worker_heartbeat_age_seconds"], worker="target-0") == 0.2
    assert value(f["hsd_worker_state"], worker="drafter-0", state="starved") == 1
    assert value(f["hsd_worker_state"], worker="drafter-0", state="busy") == 0
    assert value(f["hsd_workers"], role="target", state="busy") == 1
    assert value(f["hsd_requests"], op="get_hs") == 40
    assert value(f["hsd_errors"], code="bad_message") == 1
    assert value(f["hsd_given_back"], reason="dead") == 2
    assert f["hsd_lease_expiries"].samples[0].value == 1  # derived from the give-backs
    assert f["hsd_pool_bytes"].samples[0].value == 16000
    assert f["hsd_pool_used_bytes"].samples[0].value == 8000
    assert value(f["hsd_prefix_deviation"], stream="consumed") == 1.7
    # figures this snapshot does not carry are left out rather than invented
    for name in ("hsd_membership_version", "hsd_tail_skew", "hsd_step_mix"):
        assert name not in f


def test_figures_appear_once_the_snapshot_carries_them():
    s = copy.deepcopy(SNAPSHOT)
    s.membership_version, s.lease_expiries, s.step_mix = 3, 5, 0.97
    s.epochs[0].consumed_tail_skew, s.epochs[0].schedule_tail_skew = 0.03, 0.02
    f = families(render_prometheus(s))
    assert f["hsd_membership_version"].samples[0].value == 3
    assert f["hsd_lease_expiries"].samples[0].value == 5
    assert f["hsd_step_mix"].samples[0].value == 0.97
    assert value(f["hsd_tail_skew"], epoch="0", stream="consumed") == 0.03
    s = copy.deepcopy(SNAPSHOT)
    s.membership_version = 9
    assert families(render_prometheus(s))["hsd_membership_version"].samples[0].value == 9


def test_an_empty_bucket_keeps_its_ready_slots_series_at_zero(tmp_path):
    # the snapshot of a real core that has nothing ready: every bucket's series is there, at 0
    core = make_core(tmp_path, epochs=1)
    s = copy.deepcopy(SNAPSHOT)
    s.q_hsb = build_snapshot(core, 1.0).q_hsb
    ready = families(render_prometheus(s))["hsd_ready_slots"]
    assert {sample.labels["bucket"]: sample.value for sample in ready.samples} == {"0": 0, "1": 0, "2": 0}


def test_server_serves_only_the_latest_snapshot():
    server = MetricsServer("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert "hsd_jobs" not in urllib.request.urlopen(url, timeout=5).read().decode()  # nothing before a snapshot
        server.update(SNAPSHOT)
        later = copy.deepcopy(SNAPSHOT)
        later.steps = 8
        server.update(later)
        f = families(urllib.request.urlopen(url, timeout=5).read().decode())
        assert f["hsd_steps"].samples[0].value == 8
        assert "python_info" not in f and "process_cpu_seconds" not in f  # a registry of its own
    finally:
        server.close()
