"""Prometheus metrics of the dispatcher, exposed through ``prometheus_client``.

The dispatcher's loop thread builds a stats snapshot once a second and hands it over with
:meth:`MetricsServer.update`; the HTTP thread renders only that snapshot. A scrape therefore never
touches the core (which is single-threaded and not locked), and costs the loop nothing.

The metric families are produced by a custom collector rather than by Gauge/Counter objects:
the snapshot already holds every figure, and the core's counters only ever grow, so re-exposing
them as they are keeps counter semantics without a second copy of the state. Figures the snapshot
leaves unset (None: this core does not fill them) are simply left out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.wire.stats_figures import pool_usage
from common.wire.stats_snapshot import Snapshot

WORKER_STATES = ("busy", "idle", "starved", "blocked")
ROLES = ("target", "drafter")
LEASE_EXPIRED = "lease_expired"  # the give-back reason the core records for an expired lease


def _gauge(name: str, help_text: str, labels: tuple[str, ...], rows: list[tuple[tuple, float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=list(labels))
    for values, value in rows:
        family.add_metric([str(v) for v in values], float(value))
    return family


def _counter(name: str, help_text: str, labels: tuple[str, ...], rows: list[tuple[tuple, float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=list(labels))
    for values, value in rows:
        family.add_metric([str(v) for v in values], float(value))
    return family


def _labelled(mapping: dict[str, Any]) -> list[tuple[tuple, float]]:
    return [((key,), value) for key, value in sorted(mapping.items())]


def _lease_expiries(s: Snapshot) -> float:
    """The core's own counter when it has one; else the give-backs it recorded for expired leases."""
    if s.lease_expiries is not None:
        return s.lease_expiries
    return s.given_back.get(LEASE_EXPIRED, 0)


def snapshot_families(s: Snapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Every ``hsd_*`` metric family of one stats snapshot."""
    yield _gauge("hsd_up", "1 while the dispatcher serves; 0 once every epoch is committed.", (),
                 [((), 0 if s.done else 1)])
    yield _gauge("hsd_snapshot_age_seconds", "Seconds since the snapshot this scrape shows was taken.", (),
                 [((), max(0.0, time.time() - s.time))])
    yield _gauge("hsd_uptime_seconds", "Seconds since the dispatcher started.", (), [((), s.uptime_s)])
    yield _gauge("hsd_jobs", "Jobs by ledger state.", ("state",), _labelled(s.jobs_by_state))
    yield _gauge("hsd_ready_slots", "Ready hidden-state slots per bucket (q_hsb).", ("bucket",),
                 [((b,), n) for b, n in s.q_hsb.items()])
    yield _gauge("hsd_pool_slots", "Pool slots by state.", ("state",), _labelled(s.pool))
    usage = pool_usage(s)
    if usage is not None:
        yield _gauge("hsd_pool_bytes", "Bytes of the hidden-state pool.", (), [((), usage[1])])
        yield _gauge("hsd_pool_used_bytes", "Bytes of the pool held by a job (writing, ready or reading).", (),
                     [((), usage[0])])
    nodes = s.nodes
    yield _gauge("hsd_node_slots", "Pool slots of each node by state.", ("node", "state"),
                 [((node, state), n) for node, e in nodes.items() for state, n in e.slots.items()])
    yield _counter("hsd_node_reads", "Slots handed to each node's drafters, of their own node or another's.",
                   ("node", "where"), [((node, where), n) for node, e in nodes.items()
                                       for where, n in (("local", e.reads_local), ("remote", e.reads_remote))])
    yield _counter("hsd_steps", "Committed optimizer steps.", (), [((), s.steps)])

    epochs = s.epochs
    yield _gauge("hsd_epochs", "Epochs the run trains.", (), [((), s.epochs_total)])
    yield _gauge("hsd_epoch_jobs", "Jobs of each started epoch.", ("epoch",), [((e.epoch,), e.jobs) for e in epochs])
    yield _gauge("hsd_epoch_jobs_committed", "Committed jobs of each started epoch.", ("epoch",),
                 [((e.epoch,), e.committed) for e in epochs])
    yield _gauge("hsd_prefix_deviation", "Prefix deviation in batches, of the schedule and of the consumed stream.",
                 ("epoch", "stream"),
                 [((e.epoch, stream), value) for e in epochs for stream, value in
                  (("schedule", e.schedule_prefix_deviation), ("consumed", e.consumed_prefix_deviation))])
    skew = [((e.epoch, stream), value) for e in epochs for stream, value in
            (("schedule", e.schedule_tail_skew), ("consumed", e.consumed_tail_skew)) if value is not None]
    if skew:
        yield _gauge("hsd_tail_skew", "Total variation distance of the last 10% of the jobs from the epoch's mix.",
                     ("epoch", "stream"), skew)
    if s.step_mix is not None:
        yield _gauge("hsd_step_mix", "Share of optimizer steps that mix as many buckets as were available.", (),
                     [((), s.step_mix)])

    workers = s.workers
    per_worker = [(w.name, w.role) for w in workers]
    yield _gauge("hsd_worker_tokens_per_second", "Tokens per second of each worker since it registered.",
                 ("worker", "role"), [(key, w.tokens_per_s) for key, w in zip(per_worker, workers)])
    yield _gauge("hsd_worker_idle_ratio", "Share of its time a worker spent waiting.",
                 ("worker", "role"), [(key, w.idle_ratio) for key, w in zip(per_worker, workers)])
    yield _gauge("hsd_worker_heartbeat_age_seconds", "Seconds since a worker was last heard from.",
                 ("worker", "role"), [(key, w.heartbeat_age_s) for key, w in zip(per_worker, workers)])
    yield _counter("hsd_worker_jobs", "Jobs a worker finished since it registered.",
                   ("worker", "role"), [(key, w.jobs) for key, w in zip(per_worker, workers)])
    # One series per (worker, state), 1 for the state it is in: a stateset that sums and graphs well.
    yield _gauge("hsd_worker_state", "1 for the state a worker is in (busy, idle, starved, blocked), else 0.",
                 ("worker", "role", "state"),
                 [((*key, state), int(w.state == state)) for key, w in zip(per_worker, workers)
                  for state in WORKER_STATES])
    yield _gauge("hsd_workers", "Workers by role and state.", ("role", "state"),
                 [((role, state), sum(1 for w in workers if w.role == role and w.state == state))
                  for role in ROLES for state in WORKER_STATES])

    yield from gpu_health_families(workers)
    yield from slot_copy_families(workers)
    yield _counter("hsd_requests", "Requests by op.", ("op",), _labelled(s.requests))
    if getattr(s, "loop_cpu_s", None):  # the serving dispatcher's (a core snapshot has none)
        yield _counter("hsd_loop_cpu_seconds", "The socket loop thread's CPU seconds, by the op or phase they went to.",
                       ("what",), _labelled(s.loop_cpu_s))
        yield _counter("hsd_loop_wakeups", "The socket loop's wake-ups (its poller's returns).", (),
                       [((), s.loop_wakeups)])
    yield _counter("hsd_errors", "Error replies by code.", ("code",), _labelled(s.errors))
    yield _counter("hsd_given_back", "Jobs given back by reason.", ("reason",), _labelled(s.given_back))
    yield _counter("hsd_lease_expiries", "Leases that expired (their jobs were given back).", (),
                   [((), _lease_expiries(s))])
    if s.membership_version is not None:
        yield _gauge("hsd_membership_version", "Version of the drafter group's membership.", (),
                     [((), s.membership_version)])
    groups = s.groups
    for field, name, text in (("world_size", "hsd_group_ranks", "Ranks of a drafter group's current membership."),
                              ("waiting", "hsd_group_waiting", "Ranks waiting to join a drafter group."),
                              ("steps_since_change", "hsd_group_steps_since_change",
                               "Steps a drafter group committed since its membership last changed.")):
        if groups:
            yield _gauge(name, text, ("model",), [((m,), getattr(g, field)) for m, g in groups.items()])


GPU_GAUGES = (("memory_allocated_bytes", "hsd_worker_gpu_memory_allocated_bytes",
               "CUDA memory a GPU worker's tensors hold (torch's allocator)."),
              ("memory_reserved_bytes", "hsd_worker_gpu_memory_reserved_bytes",
               "CUDA memory a GPU worker's allocator reserved (growing job after job: a leak, e.g. IPC mappings)."),
              ("memory_peak_bytes", "hsd_worker_gpu_memory_peak_bytes",
               "The most CUDA memory a GPU worker's tensors held at once."),
              ("compiled_graphs", "hsd_worker_compiled_graphs", "Graphs dynamo compiled in a GPU worker."))


def gpu_health_families(workers) -> Iterator[GaugeMetricFamily]:
    """The GPU workers' health (memory, compiled graphs); a CPU worker has no series."""
    health = [((w.name, w.role), w.gpu_health) for w in workers if w.gpu_health is not None]
    if not health:
        return
    for field, name, text in GPU_GAUGES:
        yield _gauge(name, text, ("worker", "role"), [(key, getattr(h, field)) for key, h in health])


def slot_copy_families(workers) -> Iterator[GaugeMetricFamily]:
    """Each worker's latest slot copies (on a GPU or a CPU), once it reported any: ms p50/p99 and their count."""
    copies = [((w.name, w.role), w.slot_copies) for w in workers if w.slot_copies is not None]
    if not copies:
        return
    yield _gauge("hsd_worker_slot_copy_ms", "A worker's latest slot copies, ms each, by quantile (a target's "
                 "copy into its slot, a drafter's out of one).", ("worker", "role", "quantile"),
                 [((*key, quantile), value) for key, c in copies
                  for quantile, value in (("0.5", c.copy_ms_p50), ("0.99", c.copy_ms_p99))])
    yield _gauge("hsd_worker_slot_copies", "Slot copies a worker timed since it started.", ("worker", "role"),
                 [(key, c.copies) for key, c in copies])


class SnapshotCollector(Collector):
    """Exposes the latest snapshot handed to it; exposes nothing before the first one."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None

    def update(self, snapshot: Snapshot) -> None:
        # One reference swap: a scrape in flight keeps the snapshot it started with.
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self._snapshot
        if snapshot is not None:
            yield from snapshot_families(snapshot)


def render_prometheus(snapshot: Snapshot) -> str:
    """The text exposition of one snapshot (what a scrape returns)."""
    from prometheus_client import generate_latest
    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector()
    collector.update(snapshot)
    registry.register(collector)
    return generate_latest(registry).decode()


class MetricsServer:
    """``/metrics`` on ``host:port`` (port 0 picks a free one, read back from ``.port``)."""

    def __init__(self, host: str, port: int):
        self._collector = SnapshotCollector()
        # A registry of our own: the process-wide default one also carries Python/GC collectors.
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        self._http, self._thread = start_http_server(port, addr=host, registry=self._registry)
        self.port = self._http.server_address[1]

    def update(self, snapshot: Snapshot) -> None:
        self._collector.update(snapshot)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
