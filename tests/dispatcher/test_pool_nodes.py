"""Pools per node (dispatcher/pool.py, dispatcher/nodes.py): the reservoir held per node, locality-aware
pulls, and a whole two-node run through the core whose consumed stream is as fair as one node's."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from common.wire.messages import ModelClaim
from core_harness import Sim, make_core, small_lengths

from common.run.descriptors import NixlExport
from common.wire.stats_figures import format_nodes
from dispatcher.nodes import node_summary
from dispatcher.pool import LOCAL_SLACK, HSPool, choose_bucket
from ops.report import build_report


def _pool(**kw) -> HSPool:
    pool = HSPool(min_ready=2, target_credits=8, seed=0, **kw)
    pool.add_slots(range(0, 4), owner="ta", node="a")
    pool.add_slots(range(4, 8), owner="tb", node="b")
    return pool


def _ready(pool: HSPool, slot: int, writer: str, job_id: int, bucket: int) -> None:
    pool.begin_write(slot, writer, job_id)
    pool.publish(slot, epoch=0, bucket=bucket)


def test_reservoir_holds_per_node():
    pool = _pool()
    _ready(pool, 0, "ta", 1, 0)
    _ready(pool, 4, "tb", 2, 0)
    assert pool.servable_nodes(draining=False) == set()  # one ready on each node: neither reservoir is full
    assert not pool.may_serve(draining=False)
    assert pool.servable_nodes(draining=True) == {"a", "b"}
    _ready(pool, 1, "ta", 3, 1)
    assert pool.servable_nodes(draining=False) == {"a"}
    # a drafter of node b is served node a's slot: b's one ready slot stays in its reservoir
    job = pool.pick(0, eligible={0: 1.0, 1: 0.5}, window=set(), node="b", servable=pool.servable_nodes(False))
    assert job.node == "a"
    assert pool.node_counts()["b"]["ready"] == 1 and pool.node_min_ready("b") == 2


def test_fairness_picks_the_bucket_locality_the_slot():
    pool = _pool()
    _ready(pool, 0, "ta", 1, 0)
    _ready(pool, 4, "tb", 2, 0)
    _ready(pool, 5, "tb", 3, 1)
    for _ in range(5):  # bucket 0 lags most: each drafter gets its own node's slot of it
        assert pool.pick(0, eligible={0: 1.0, 1: 0.4}, window=set(), node="a").slot == 0
        assert pool.pick(0, eligible={0: 1.0, 1: 0.4}, window=set(), node="b").slot == 4
    # bucket 1 lags most and only node b has it (the fairness bound asks): node a's drafter reads it
    assert pool.pick(0, eligible={0: 0.4, 1: 1.0}, window=set(), node="a").slot == 5
    # a slot of the dispatcher's own arena is local to everyone
    pool.add_slots([8])
    _ready(pool, 8, "tc", 4, 1)
    assert pool.pick(0, eligible={1: 2.0}, window=set(), node="a").slot == 8


def test_remote_read_waits_remote_after_s_and_any_ignores_nodes():
    pool = _pool(remote_after_s=2.0)
    _ready(pool, 4, "tb", 2, 0)
    assert pool.pick(0, eligible={0: 1.0}, window=set(), node="a", waited_s=0.5) is None
    assert pool.pick(0, eligible={0: 1.0}, window=set(), node="a", waited_s=2.5).node == "b"
    anywhere = _pool(locality="any")
    _ready(anywhere, 0, "ta", 1, 0)
    _ready(anywhere, 4, "tb", 2, 0)
    nodes = Counter(anywhere.pick(0, eligible={0: 1.0}, window=set(), node="a").node for _ in range(40))
    assert nodes["a"] > 0 and nodes["b"] > 0
    with pytest.raises(ValueError, match="locality"):
        HSPool(min_ready=1, target_credits=1, locality="nearest")


def _two_node_run(run_dir, *, drafter_nodes: list[str], target_nodes: list[str]):
    """A whole run through the core: each target's 4 slots on its node, drafters on the given nodes."""
    core = make_core(run_dir, lengths=small_lengths(scale=4), epochs=2, shared_slots=0, min_ready=2, credits=2)
    targets, drafters = [], []
    for i, node in enumerate(target_nodes):
        t = core.register(role="target", name=f"t{i}", pid=100 + i, host="h", gpu=None, now=0.0, node=node).id
        core.register_slots(t, NixlExport(node=node, arena=f"arena-{i}", agent=f"t{i}", metadata=b"", base=0,
                                              nbytes=4 << 20), 4, 0.0)
        targets.append(t)
    for i, node in enumerate(drafter_nodes):
        drafters.append(core.register(role="drafter", name=f"d{i}", pid=200 + i, host="h", gpu=None, now=0.0,
                                      node=node, model=ModelClaim(id=f"m{i}", step=0)).id)
    random.Random(0).shuffle(drafters)
    sim = Sim(core, targets, drafters)
    sim.run()
    assert core.done
    core.close()
    return core, build_report(run_dir)


def test_two_node_run_reads_mostly_locally_and_stays_fair(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    # node b has one target of three: its drafter reads node a's slots now and then
    _, one = _two_node_run(tmp_path / "one", drafter_nodes=["a", "a"], target_nodes=["a", "a", "a"])
    core, two = _two_node_run(tmp_path / "two", drafter_nodes=["a", "b"], target_nodes=["a", "a", "b"])
    reads = two["reads"]
    assert reads["local"] + reads["remote"] == sum(core.counters.reads.values())
    assert reads["local"] >= 0.85 * (reads["local"] + reads["remote"]), reads  # 90 of 96
    assert reads["remote"] > 0 and one["reads"]["remote"] == 0
    for key in ("prefix_deviation", "tail_skew"):  # the same data: within LOCAL_SLACK of one node's
        assert two[key]["consumed"] <= one[key]["consumed"] + LOCAL_SLACK, (key, one[key], two[key])
    assert two["step_mix"] >= one["step_mix"] - 0.05
    assert (two["duplicates"], two["lost"]) == (0, 0)
    nodes = node_summary(core.pool, core.registry.on_node, core.counters.reads, home="a")
    assert set(nodes) == {"a", "b"} and nodes["b"].targets == nodes["b"].drafters == 1
    assert sum(nodes["b"].slots.values()) == 4 and sum(nodes["a"].slots.values()) == 8
    lines = format_nodes(nodes, slot_bytes=2**20)
    assert len(lines) == 2 and "node b: 1 target(s), 1 drafter(s); 4 slots" in lines[1]


def test_targets_on_one_node_drafters_on_another(tmp_path):
    core, report = _two_node_run(tmp_path, drafter_nodes=["b", "b"], target_nodes=["a"])
    assert report["reads"]["local"] == 0 and report["reads"]["remote"] == report["jobs_total"]
    assert (report["committed"], report["duplicates"], report["lost"]) == (report["jobs_total"], 0, 0)


def _walking_pick(pool: HSPool, ready: dict[int, tuple[int, int, str | None]], *, eligible: dict[int, float],
                  window: set[int], node: str | None, servable: set[str | None], waited_s: float):
    """What a pick draws when it walks every ready slot and sorts the candidates by job id (the
    reference the indexed pick must match draw for draw). ``ready``: job id -> (bucket, slot, node)."""
    rng = pool.rng
    by_bucket: dict[int, list[int]] = {}
    for job_id, (bucket, _, slot_node) in ready.items():
        if slot_node in servable:
            by_bucket.setdefault(bucket, []).append(job_id)
    buckets = sorted({b for b, _, _ in ready.values()}) if pool.pull == "random" else list(eligible)
    candidates = {b: sorted(by_bucket[b]) for b in buckets if by_bucket.get(b)}
    if not candidates:
        return None
    if pool.locality == "prefer" and node is not None:
        local = {b: [j for j in ids if ready[j][2] in (None, node)] for b, ids in candidates.items()}
        local = {b: ids for b, ids in local.items() if ids}
        if not local and waited_s < pool.remote_after_s:
            return None
        if pool.pull == "deficit":
            bucket = choose_bucket(eligible, window=window, rng=rng, available=candidates)
            if bucket not in local:
                near = {b: eligible[b] for b in local if eligible[b] >= eligible[bucket] - LOCAL_SLACK
                        and (b not in window or bucket in window)}
                if near:
                    bucket = choose_bucket(near, window=window, rng=rng)
            return rng.choice(local.get(bucket) or candidates[bucket])
        if local:
            candidates = local
    if pool.pull == "random":
        return rng.choice(sorted(j for ids in candidates.values() for j in ids))
    return rng.choice(candidates[choose_bucket(eligible, window=window, rng=rng, available=candidates)])


@pytest.mark.parametrize("pull,locality", [("deficit", "prefer"), ("random", "prefer"), ("deficit", "any")])
def test_the_indexed_multi_node_pick_draws_what_walking_every_ready_slot_draws(pull, locality):
    """Across nodes a pick looks only at the ready ids of the servable nodes (and of the drafter's own
    node and the arena), kept in order per node: it must draw the same job, with the same random
    numbers, as walking every ready slot. Three nodes and the arena, reservoirs that block some of
    them, drafters of every node, ids published in no order, readers that die and put a slot back."""
    rng = random.Random(11)
    pool = HSPool(min_ready=3, target_credits=100, pull=pull, seed=5, locality=locality, remote_after_s=1.0)
    twin = HSPool(min_ready=3, target_credits=100, pull=pull, seed=5, locality=locality, remote_after_s=1.0)
    owners = {"a": "ta", "b": "tb", "c": "tc", None: None}
    for p in (pool, twin):
        for k, node in enumerate(owners):
            p.add_slots(range(10 * k, 10 * k + 8), owner=owners[node], node=node)
    totals, taken = {0: 40, 1: 25, 2: 20, 3: 15}, Counter()
    ready: dict[int, tuple[int, int, str | None]] = {}
    job_ids = iter(rng.sample(range(10**9), 3000))
    picked = 0
    for _ in range(600):
        for node, owner in owners.items():
            slot = pool.writable_slot(owner or "arena-writer")
            if slot is not None and pool.slots[slot].node == node and rng.random() < 0.5:
                job_id, bucket = next(job_ids), rng.choice(list(totals))
                for p in (pool, twin):
                    p.begin_write(slot, owner or "arena-writer", job_id)
                    p.publish(slot, epoch=0, bucket=bucket)
                ready[job_id] = (bucket, slot, node)
        servable = pool.servable_nodes(draining=rng.random() < 0.2)
        eligible = pool.eligible(0, totals=totals, taken=taken)
        window = set(rng.sample(list(totals), rng.randint(0, 3)))
        node, waited_s = rng.choice(list(owners)), rng.choice([0.0, 5.0])
        got = pool.pick(0, eligible=eligible, window=window, node=node, servable=servable, waited_s=waited_s)
        want = _walking_pick(twin, ready, eligible=eligible, window=window, node=node, servable=servable,
                             waited_s=waited_s)
        assert (got.job_id if got else None) == want
        if got is None:
            continue
        assert (got.bucket, got.slot, got.node) == ready[got.job_id]
        died = rng.random() < 0.2  # the reader died before its copy: the slot is ready again
        for p in (pool, twin):
            p.begin_read(got)
            if died:
                p.unread(got.slot, epoch=0, bucket=got.bucket)
            else:
                p.release(got.slot)
        if died:
            continue
        del ready[got.job_id]
        taken[got.bucket] += 1
        picked += 1
    assert pool.rng.random() == twin.rng.random()
    assert picked > 200 and pool.num_ready == len(ready)
