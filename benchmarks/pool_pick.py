"""The pool's pick across nodes (``pool.transport=nixl``), timed in-process: a section of
``hsd bench dispatcher``.

On one node a pick draws from each bucket's ordered ready ids at once; across nodes it must leave
out the slots of nodes below their reservoir and prefer the drafter's own node's. This times that
general path alone: ``nodes`` nodes, each target's node kept at ``ready_per_node`` ready slots in
six buckets, drafters of every node in turn picking with the reservoir, the deficit pull and
``locality=prefer`` as the core asks (``servable_nodes``, ``eligible``, then ``pick``), each pick's
slot read and refilled. ``pick_us`` is the mean of ``pick`` alone.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

from dispatcher.pool import HSPool

BUCKETS = 6
SIZES = ((8, 16), (64, 16), (250, 32))  # (nodes, ready slots a node): up to 8,000 ready, 2,000 GPUs' targets


def time_picks(nodes: int, ready_per_node: int, picks: int = 5000, seed: int = 0) -> dict[str, Any]:
    pool = HSPool(min_ready=4, target_credits=10**6, pull="deficit", seed=seed, locality="prefer")
    rng = random.Random(seed)
    per_node = ready_per_node + 2
    for n in range(nodes):
        pool.add_slots(range(n * per_node, (n + 1) * per_node), owner=f"t{n}", node=f"n{n}")
    next_job = iter(range(1, 10**12))

    def refill(n: int) -> None:
        while pool.ready_on(f"n{n}") < ready_per_node:
            slot = pool.writable_slot(f"t{n}")
            if slot is None:
                return
            pool.begin_write(slot, f"t{n}", next(next_job))
            pool.publish(slot, epoch=0, bucket=rng.randrange(BUCKETS))

    for n in range(nodes):
        refill(n)
    totals, taken = dict.fromkeys(range(BUCKETS), 100), Counter()
    spent, served = 0.0, 0
    for i in range(picks):
        servable = pool.servable_nodes(draining=False)
        eligible = pool.eligible(0, totals=totals, taken=taken)
        started = time.perf_counter()
        ready = pool.pick(0, eligible=eligible, window=set(), node=f"n{i % nodes}", servable=servable, waited_s=1.0)
        spent += time.perf_counter() - started
        if ready is None:
            continue
        served += 1
        taken[ready.bucket] += 1
        pool.begin_read(ready)
        pool.release(ready.slot)
        refill(int(ready.node[1:]))
    return {"nodes": nodes, "ready": pool.num_ready, "picks": picks, "served": served,
            "pick_us": round(1e6 * spent / picks, 1)}


def pick_section() -> list[dict[str, Any]]:
    return [time_picks(nodes, ready_per_node) for nodes, ready_per_node in SIZES]
