"""/metrics of a real `hsd launch` (sim workers), scraped mid-run and parsed as Prometheus reads it."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from hsd_testing import kill_tree, sim_args, start_hsd, wait_for, wait_for_stats

BUCKETS = [str(b) for b in range(6)]  # q_hsb labels buckets by index


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_metrics_of_a_running_launch(run_dir, tmp_path):
    port = free_port()
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=1", "target.sim_cost_per_token=1e-5",
                    "drafter.sim_cost_per_token=5e-6", f"dispatcher.metrics_port={port}")
    launch = start_hsd("launch", *args, log_path=tmp_path / "launch.log")
    try:
        def mid_run():
            f = scrape(port)
            if not f or "hsd_steps" not in f or "hsd_worker_state" not in f:
                return None
            workers = {s.labels["worker"] for s in f["hsd_worker_state"].samples}
            return f if f["hsd_steps"].samples[0].value >= 2 and len(workers) == 3 else None
        f = wait_for(mid_run, 120, what="a scrape with 3 workers and 2 committed steps")

        jobs = {labels[0][1]: v for labels, v in samples(f["hsd_jobs"]).items()}
        assert set(jobs) == {"pending", "extracting", "ready", "training", "consumed", "committed"}
        epoch_jobs = sum(samples(f["hsd_epoch_jobs"]).values())
        assert sum(jobs.values()) == epoch_jobs > 50
        assert jobs["committed"] == sum(samples(f["hsd_epoch_jobs_committed"]).values()) > 0
        assert {s.labels["bucket"] for s in f["hsd_ready_slots"].samples} <= set(BUCKETS)
        assert all(s.value >= 0 for s in f["hsd_ready_slots"].samples)
        assert f["hsd_steps"].type == "counter" and f["hsd_steps"].samples[0].name == "hsd_steps_total"
        assert f["hsd_up"].samples[0].value == 1

        for name in ("hsd_worker_tokens_per_second", "hsd_worker_idle_ratio", "hsd_worker_heartbeat_age_seconds"):
            assert len(f[name].samples) == 3, name
        rates = {s.labels["worker"]: s.value for s in f["hsd_worker_tokens_per_second"].samples}
        assert all(rate > 0 for rate in rates.values()), rates  # every worker has moved tokens by step 2
        assert all(0 <= s.value <= 1 for s in f["hsd_worker_idle_ratio"].samples)
        assert all(0 <= s.value < 3 for s in f["hsd_worker_heartbeat_age_seconds"].samples)  # < worker_timeout_s
        states: dict[str, float] = {}
        for s in f["hsd_worker_state"].samples:
            assert s.labels["state"] in ("busy", "idle", "starved", "blocked")
            states[s.labels["worker"]] = states.get(s.labels["worker"], 0) + s.value
        assert states == {w: 1 for w in rates}  # exactly one state per worker
        assert sum(samples(f["hsd_workers"]).values()) == 3

        requests = {s.labels["op"]: s.value for s in f["hsd_requests"].samples}
        assert requests["register"] >= 3 and requests["get_job"] > 0 and requests["get_hs"] > 0
        assert all(s.name == "hsd_requests_total" for s in f["hsd_requests"].samples)
        for name in ("hsd_errors", "hsd_given_back", "hsd_lease_expiries"):
            assert f[name].type == "counter", name
        assert sum(s.value for s in f["hsd_errors"].samples) == 0
        assert f["hsd_lease_expiries"].samples[0].value == 0

        total = f["hsd_pool_bytes"].samples[0].value
        used = f["hsd_pool_used_bytes"].samples[0].value
        assert total > 0 and 0 <= used <= total
        assert sum(samples(f["hsd_pool_slots"]).values()) == 16  # pool.slots default
        deviation = {s.labels["stream"]: s.value for s in f["hsd_prefix_deviation"].samples}
        assert 0 <= deviation["schedule"] <= 2 and 0 <= deviation["consumed"] <= 3
        if "hsd_membership_version" in f:
            assert f["hsd_membership_version"].samples[0].value >= 0

        # Every worker's slot copies (the targets' writes, the drafter's reads; CPU workers over shm)
        # reach the stats snapshot and /metrics with a heartbeat: a busy worker's go out every 8th interval.
        def all_copied(snapshot):
            copies = {w["name"]: w.get("slot_copies") for w in snapshot["workers"]}
            return copies if len(copies) == 3 and all(copies.values()) else None
        copies = wait_for_stats(run_dir, all_copied, 60, what="every worker's slot copy times in the stats")
        assert all(c["copies"] > 0 and 0 < c["copy_ms_p50"] <= c["copy_ms_p99"] for c in copies.values()), copies
        f = wait_for(lambda: (lambda f: f if f and "hsd_worker_slot_copy_ms" in f
                              and len(f["hsd_worker_slot_copy_ms"].samples) == 6 else None)(scrape(port)),
                     30, what="a scrape with every worker's slot copy times")
        copy_ms = samples(f["hsd_worker_slot_copy_ms"])
        assert {dict(labels)["role"] for labels in copy_ms} == {"target", "drafter"}
        assert all(value > 0 for value in copy_ms.values()), copy_ms
        assert all(value > 0 for value in samples(f["hsd_worker_slot_copies"]).values())

        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-3000:]
        assert scrape(port) is None  # the endpoint went away with the dispatcher
    finally:
        kill_tree(launch)
