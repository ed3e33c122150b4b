"""Figures and lines derived from a stats snapshot: the dispatcher's progress line (ready slots per
bucket) and ``/metrics`` (pool bytes), which ``hsd stats`` shows too, and ``hsd stats``'s per-node
lines. They live beside the snapshot, below both the daemon and the operator's view, so neither
imports the other."""

from __future__ import annotations

from common.wire.stats_snapshot import NodeView, Snapshot


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each of a snapshot's counters (``requests``, ``loop_cpu_s``, ...) grew by between two
    snapshots of one dispatcher; those that did not move are left out."""
    return {key: after.get(key, 0) - before.get(key, 0) for key in sorted(set(before) | set(after))
            if after.get(key, 0) - before.get(key, 0)}


def format_q_hsb(q_hsb: dict) -> str:
    """Ready slots per bucket as ``b0:1  b1:0  ...``: every bucket, empty ones as 0."""
    return "  ".join(f"b{b}:{n}" for b, n in q_hsb.items()) or "(no bucket)"


def pool_usage(s: Snapshot) -> tuple[int, int] | None:
    """(bytes held by a job, bytes of the pool), from the slot states and the transport's slot size."""
    pool = s.pool
    if not pool:
        return None
    slot_bytes = s.transport.slot_bytes
    total_slots = sum(pool.values())
    return (total_slots - pool.get("free", 0)) * slot_bytes, total_slots * slot_bytes


def format_nodes(nodes: dict[str, NodeView], slot_bytes: int) -> list[str]:
    """One ``hsd stats`` line per node, once a run has more than one."""
    if len(nodes) < 2:
        return []
    lines = []
    for name, e in nodes.items():
        total = sum(e.slots.values())
        used = total - e.slots.get("free", 0)
        lines.append(f"node {name}: {e.targets} target(s), {e.drafters} drafter(s); {total} slots "
                     f"({used * slot_bytes / 2**20:.1f} of {total * slot_bytes / 2**20:.1f} MiB held), ready "
                     f"{e.slots.get('ready', 0)} (min {e.min_ready}); reads local {e.reads_local} "
                     f"remote {e.reads_remote}")
    return lines
