"""The per-node view of a run for ``hsd stats`` and ``/metrics``: each node's slots, reservoir, workers
and reads. Pure: built from the core's pool, workers and counters (the policy is in dispatcher/pool.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from common.wire.stats_snapshot import NodeView


def node_summary(pool: Any, on_node: Counter, reads: Counter, *, home: str) -> dict[str, NodeView]:
    """node -> its slots by state, reserve (min_ready), targets, drafters and reads (local, remote).

    ``on_node`` counts the live workers by (node, role); ``home`` names the dispatcher's node, where
    its own arena's slots (node None) live.
    """
    out: dict[str, NodeView] = {}

    def entry(node: str | None) -> NodeView:
        name = node or home
        if name not in out:
            out[name] = NodeView(slots={}, min_ready=0, targets=0, drafters=0, reads_local=0, reads_remote=0)
        return out[name]

    for node, counts in pool.node_counts().items():
        e = entry(node)
        e.slots, e.min_ready = counts, pool.node_min_ready(node)
    for (node, role), n in on_node.items():
        e = entry(node)
        if role == "target":
            e.targets += n
        else:
            e.drafters += n
    for (node, kind), n in reads.items():
        e = entry(node)
        if kind == "local":
            e.reads_local += n
        else:
            e.reads_remote += n
    return dict(sorted(out.items()))
