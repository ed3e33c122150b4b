"""Figures derived from a stats snapshot that the daemon itself shows as well as ``hsd stats``: the
dispatcher's progress line (ready slots per bucket) and ``/metrics`` (pool bytes). They live beside
the snapshot, below the operator's view, so the daemon never imports its own client's text view."""

from __future__ import annotations

from common.wire.stats_snapshot import Snapshot


def format_q_hsb(q_hsb: dict) -> str:
    """Ready slots per bucket as ``b0:1  b1:0  ...``: every bucket, empty ones as 0."""
    return "  ".join(f"b{b}:{n}" for b, n in q_hsb.items()) or "(no bucket)"


def pool_usage(s: Snapshot) -> tuple[int, int] | None:
    """(bytes held by a job, bytes of the pool), from the slot states and the transport's slot size."""
    transport, pool = s.transport, s.pool
    if not transport or not pool:
        return None
    slot_bytes = transport["slot_bytes"]
    total_slots = sum(pool.values())
    return (total_slots - pool.get("free", 0)) * slot_bytes, total_slots * slot_bytes
