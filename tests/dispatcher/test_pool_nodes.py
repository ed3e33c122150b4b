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
from dispatcher.pool import LOCAL_SLACK, HSPool
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
    nodes = node_summary(core.pool, core.workers, core.counters.reads, home="a")
    assert set(nodes) == {"a", "b"} and nodes["b"].targets == nodes["b"].drafters == 1
    assert sum(nodes["b"].slots.values()) == 4 and sum(nodes["a"].slots.values()) == 8
    lines = format_nodes(nodes, slot_bytes=2**20)
    assert len(lines) == 2 and "node b: 1 target(s), 1 drafter(s); 4 slots" in lines[1]


def test_targets_on_one_node_drafters_on_another(tmp_path):
    core, report = _two_node_run(tmp_path, drafter_nodes=["b", "b"], target_nodes=["a"])
    assert report["reads"]["local"] == 0 and report["reads"]["remote"] == report["jobs_total"]
    assert (report["committed"], report["duplicates"], report["lost"]) == (report["jobs_total"], 0, 0)
