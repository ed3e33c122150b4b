"""Per-target queues (schedule.assignment=per_target): job i only to the target of queue i mod T.

The naive assignment this project replaces, kept so that benchmarks can measure against it.
"""

import numpy as np
import pytest

from core_harness import BUCKETS, TOKENS, Sim, all_job_ids, register, small_lengths
from common.run.records.events import JobReady, WorkerJoined
from common.run.records.job_ids import make_job_id, split_job_id
from common.run.records.journal import read_journal
from dispatcher.core import DispatcherCore
from dispatcher.core_types import CoreOptions
from dispatcher.journal import Journal
from dispatcher.ledger import JobLedger, JobState, LedgerError
from dispatcher.pool import HSPool


def test_each_queue_hands_out_its_residue_class_in_order():
    ledger = JobLedger(num_queues=3)
    ledger.add_epoch(0, np.zeros(8, dtype=np.int16))
    ledger.add_epoch(1, np.zeros(4, dtype=np.int16))
    taken = {k: [] for k in range(3)}
    for k in (2, 0, 1, 2, 2, 0, 1, 2, 2, 0, 1, 2):
        if ledger.peek_pending(k) is None:
            continue
        taken[k].append(ledger.start_extract(f"t{k}", 0, 1, 0.0, 10.0, queue=k).job_id)
    assert taken[0] == [make_job_id(0, 0), make_job_id(0, 3), make_job_id(0, 6)]
    assert taken[1] == [make_job_id(0, 1), make_job_id(0, 4), make_job_id(0, 7)]
    # queue 2 runs out of epoch 0 (indices 2, 5) and goes on with its jobs of epoch 1 (index 2)
    assert taken[2] == [make_job_id(0, 2), make_job_id(0, 5), make_job_id(1, 2)]
    assert ledger.peek_pending(2) is None and ledger.peek_pending(0) == make_job_id(1, 0)


def test_a_given_back_job_returns_to_the_head_of_its_own_queue():
    ledger = JobLedger(num_queues=2)
    ledger.add_epoch(0, np.zeros(6, dtype=np.int16))
    first = ledger.start_extract("t0", 0, 1, 0.0, 10.0, queue=0)
    ledger.start_extract("t0", 1, 1, 0.0, 10.0, queue=0)
    ledger.give_back(first)
    assert ledger.peek_pending(1) == make_job_id(0, 1)  # queue 1 never sees it
    assert ledger.peek_pending(0) == first.job_id
    assert ledger.start_extract("t0", 0, 2, 0.0, 10.0, queue=0).job_id == first.job_id
    assert ledger.peek_pending(0) == make_job_id(0, 4)


def test_cursor_walk_is_amortized_over_a_large_epoch():
    """Each queue's cursor only moves forward by T: handing out every job costs O(jobs) in total."""
    num_jobs, num_queues = 20_000, 5
    ledger = JobLedger(num_queues=num_queues)
    ledger.add_epoch(0, np.zeros(num_jobs, dtype=np.int16))
    for k in range(num_queues):
        for _ in range(num_jobs // num_queues):
            job = ledger.start_extract("t", 0, 1, 0.0, 10.0, queue=k)
            assert split_job_id(job.job_id)[1] % num_queues == k
        assert ledger.peek_pending(k) is None
    assert ledger.num_pending == 0


def test_a_ledger_needs_at_least_one_queue():
    with pytest.raises(ValueError, match="num_queues"):
        JobLedger(num_queues=0)
    with pytest.raises(LedgerError, match="no pending"):
        JobLedger(num_queues=2).start_extract("t", 0, 1, 0.0, 1.0, queue=1)


def make_per_target_core(run_dir, num_targets):
    options = CoreOptions(lease_s=1000.0, worker_timeout_s=1e6, epochs=2, run_seed=3, buckets=list(BUCKETS),
                          tokens_per_batch=TOKENS, order="shuffle", num_target_queues=num_targets)
    pool = HSPool(min_ready=0, target_credits=2, pull="random", seed=1)
    return DispatcherCore(options, run_dir=run_dir, lengths=small_lengths(scale=2), journal=Journal(run_dir),
                          pool=pool, shared_slots=6, now=0.0)


def test_core_serves_each_target_only_its_own_queue(tmp_path):
    core = make_per_target_core(tmp_path, num_targets=2)
    targets, drafters = register(core, "target", 2), register(core, "drafter", 1)
    queue_of = {t: core.workers[t].queue for t in targets}
    assert sorted(queue_of.values()) == [0, 1]
    sim = Sim(core, targets, drafters)
    sim.run()
    assert core.done and sorted(sim.committed_ids()) == sorted(all_job_ids(core))
    core.journal.close()
    events = list(read_journal(tmp_path))
    joined = {e.w: e.queue for e in events if isinstance(e, WorkerJoined) and e.role == "target"}
    assert joined == queue_of
    ready = [e for e in events if isinstance(e, JobReady)]
    assert len(ready) == len(sim.committed_ids())
    for e in ready:
        assert split_job_id(e.job)[1] % 2 == joined[e.w], e


def test_a_queue_without_its_target_waits_and_a_new_target_takes_it_over(tmp_path):
    core = make_per_target_core(tmp_path, num_targets=2)
    t0, t1 = register(core, "target", 2)
    extra = core.register(role="target", name="spare", pid=77, host="h", gpu=None, now=0.0)
    assert extra.queue is None and core.get_job(extra.id, 1.0) is None  # every queue has its target
    assert core.workers[extra.id].wait_reason == "starved"
    core.deregister(t1, 1.0)
    again = core.register(role="target", name="target1", pid=78, host="h", gpu=None, now=2.0)
    assert again.queue == 1
    grant = core.get_job(again.id, 2.0)
    assert grant.job.state is JobState.EXTRACTING and split_job_id(grant.job.job_id)[1] % 2 == 1
    core.journal.close()


def test_config_keys_of_the_assignment_and_the_sim_costs():
    from common.run.config import ConfigError, load_config
    config = load_config(None, ["schedule.assignment=per_target", "target.count=5"])
    assert CoreOptions.from_config(config).num_target_queues == 5
    assert CoreOptions.from_config(load_config(None, ["target.count=5"])).num_target_queues == 0
    with pytest.raises(ConfigError, match="target.count"):
        load_config(None, ["schedule.assignment=per_target", "target.count=0"])
    with pytest.raises(ConfigError, match="schedule.assignment"):
        load_config(None, ["schedule.assignment=round_robin"])
    with pytest.raises(ConfigError, match="drafter.sim_cost_per_sequence"):
        load_config(None, ["drafter.sim_cost_per_sequence=-1"])
    defaults = load_config(None, [])
    assert defaults.target.sim_cost_attention == 0.0 and defaults.drafter.sim_cost_per_sequence == 0.0

