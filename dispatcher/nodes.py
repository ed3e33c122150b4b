"""The per-node view of a run for ``hsd stats`` and ``/metrics``: each node's slots, reservoir, workers
and reads. Pure: built from the core's pool, workers and counters (the policy is in dispatcher/pool.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def node_summary(pool: Any, workers: dict[str, Any], reads: Counter, *, home: str) -> dict[str, dict[str, Any]]:
    """node -> {slots: {state: n}, min_ready, targets, drafters, reads_local, reads_remote}.

    ``home`` names the dispatcher's node, where its own arena's slots (node None) live.
    """
    out: dict[str, dict[str, Any]] = {}

    def entry(node: str | None) -> dict[str, Any]:
        name = node or home
        if name not in out:
            out[name] = {"slots": {}, "min_ready": 0, "targets": 0, "drafters": 0, "reads_local": 0,
                         "reads_remote": 0}
        return out[name]

    for node, counts in pool.node_counts().items():
        e = entry(node)
        e["slots"], e["min_ready"] = counts, pool.node_min_ready(node)
    for worker in workers.values():
        entry(worker.node)[f"{worker.role}s"] += 1
    for (node, kind), n in reads.items():
        entry(node)[f"reads_{kind}"] += n
    return dict(sorted(out.items()))


def format_nodes(nodes: dict[str, dict[str, Any]], slot_bytes: int) -> list[str]:
    """One ``hsd stats`` line per node, once a run has more than one."""
    if len(nodes) < 2:
        return []
    lines = []
    for name, e in nodes.items():
        slots = e["slots"]
        total = sum(slots.values())
        used = total - slots.get("free", 0)
        lines.append(f"node {name}: {e['targets']} target(s), {e['drafters']} drafter(s); {total} slots "
                     f"({used * slot_bytes / 2**20:.1f} of {total * slot_bytes / 2**20:.1f} MiB held), ready "
                     f"{slots.get('ready', 0)} (min {e['min_ready']}); reads local {e['reads_local']} "
                     f"remote {e['reads_remote']}")
    return lines
