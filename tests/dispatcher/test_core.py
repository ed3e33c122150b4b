"""dispatcher/core.py: the dispatcher's decisions driven by hand, no sockets."""

from collections import Counter

import msgspec
import pytest

from common.run.capture_contract import CaptureContract
from core_harness import Sim, all_job_ids, make_core, register, small_lengths
from common.run.records.events import EpochCommitted, JobGivenBack, StepCommitted
from common.run.records.job_ids import make_job_id
from common.run.records.journal import read_journal
from common.run.records.schedule import load_schedule
from dispatcher.core_types import DONE, Incompatible, UnknownWorker
from dispatcher.ledger import JobState, LedgerError
from dispatcher.snapshot import build_snapshot, worker_state

def test_two_targets_two_drafters_two_epochs(tmp_path):
    core = make_core(tmp_path)
    targets, drafters = register(core, "target", 2), register(core, "drafter", 2)
    assert targets == ["t0.0", "t1.0"] and drafters == ["d0.0", "d1.0"]
    sim = Sim(core, targets, drafters)
    sim.run()
    assert core.done
    assert len(core.epoch_jobs) == 2 and all(n == 12 for n in core.epoch_jobs.values())
    committed = sim.committed_ids()
    assert len(committed) == len(set(committed)) == 24           # exactly once
    assert set(committed) == all_job_ids(core) and not core.ledger.jobs   # nothing left in flight
    for d in ("d0.0", "d1.0"):   # each model's steps count 1, 2, 3, ...
        steps = [step for step, drafter, _ in sim.commits if drafter == d]
        assert steps == list(range(1, len(steps) + 1))
    assert {d for _, d, _ in sim.commits} == {"d0.0", "d1.0"}
    assert core.ledger.counts_by_state()["committed"] == 24
    assert core.pool.counts()["free"] == 6
    # every job trained with the samples of its schedule batch
    for e in core.epoch_jobs:
        schedule = load_schedule(tmp_path, e)
        assert all(core.ledger.state_of(make_job_id(e, i)) is JobState.COMMITTED for i in range(12))
        assert schedule.num_jobs == 12
    # done from now on
    assert core.get_job("t0.0", sim.now) == DONE
    assert core.get_hs("d1.0", sim.now) == (DONE, False)
    # the journal agrees: every job in exactly one commit
    journal_jobs = [j for e in read_journal(tmp_path, only=(StepCommitted,)) for j in e.jobs]
    assert Counter(journal_jobs) == Counter(committed)
    epochs_committed = [e.epoch for e in read_journal(tmp_path, only=(EpochCommitted,))]
    assert epochs_committed == [0, 1]
    snapshot = build_snapshot(core, sim.now)
    assert snapshot.done is True and snapshot.jobs_by_state["committed"] == 24


def test_the_live_step_mix_is_the_share_of_steps_the_journal_records_as_mixed(tmp_path):
    for name, pull in (("deficit", "deficit"), ("random", "random")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        core = make_core(run_dir, lengths=small_lengths(scale=4))
        assert build_snapshot(core, 0.0).step_mix is None  # no step yet: no figure
        core.pool.pull = pull  # random pulls take a bucket the step already holds now and then
        sim = Sim(core, register(core, "target", 2), register(core, "drafter", 2), accum=3)
        sim.run(max_rounds=2000)
        assert core.done
        steps = list(read_journal(run_dir, only=(StepCommitted,)))
        mixed = sum(e.mixed for e in steps) / len(steps)
        assert len(steps) == len(sim.commits) and build_snapshot(core, sim.now).step_mix == round(mixed, 4)
        assert (mixed == 1.0) if pull == "deficit" else (0.0 < mixed < 1.0)


def test_commit_errors(tmp_path):
    core = make_core(tmp_path, epochs=1, min_ready=1)
    (t,), (d0, d1) = register(core, "target", 1), register(core, "drafter", 2)
    grant = core.get_job(t, 1.0)
    core.job_ready(t, grant.job.job_id, grant.job.generation, 0.0, 1.0)
    hs, _ = core.get_hs(d0, 1.0)
    assert hs.job.job_id == grant.job.job_id and hs.slot == grant.slot and hs.job.generation == grant.job.generation
    with pytest.raises(LedgerError):
        core.commit_step(d0, [hs.job.job_id], 0.0, 1.0)     # not consumed yet
    core.consumed(d0, hs.job.job_id, 1.0)
    with pytest.raises(LedgerError):
        core.commit_step(d1, [hs.job.job_id], 0.0, 1.0)     # another drafter's job
    with pytest.raises(LedgerError):
        core.commit_step(d0, [], 0.0, 1.0)
    with pytest.raises(LedgerError):
        core.job_ready(t, grant.job.job_id, grant.job.generation, 0.0, 1.0)   # ready twice
    with pytest.raises(UnknownWorker):
        core.get_job("t9", 1.0)
    assert core.commit_step(d0, [hs.job.job_id], 0.0, 1.0, model="m", step=1) == 1
    # a retried commit (its reply was lost) gets the first answer, and commits nothing twice
    assert core.commit_step(d0, [hs.job.job_id], 0.0, 1.0, model="m", step=1) == 1
    assert core.num_steps == 1
    assert sum(1 for e in read_journal(tmp_path) if isinstance(e, StepCommitted)) == 1


# -- dead workers ---------------------------------------------------------------------------------

def test_dead_target_gives_its_job_back_and_it_is_handed_out_again(tmp_path):
    core = make_core(tmp_path, epochs=1)
    t0, t1 = register(core, "target", 2)
    (d0,) = register(core, "drafter", 1)
    grant = core.get_job(t0, 1.0)
    assert grant.job.job_id == make_job_id(0, 0)
    second = core.get_job(t0, 1.0)
    assert core.pool.counts()["writing"] == 2
    dead = core.sweep(2.0, is_alive=lambda w: w.id != "t0.0")
    assert dead == ["t0.0"]
    assert "t0.0" not in core.workers and set(core.workers) == {"t1.0", "d0.0"}
    assert grant.job.state is JobState.PENDING and second.job.state is JobState.PENDING
    assert core.pool.counts()["writing"] == 0 and core.pool.counts()["free"] == 6
    again = core.get_job(t1, 3.0)
    assert again.job.job_id == grant.job.job_id              # back at the head of the queue
    assert again.job.holder == "t1.0" and again.job.generation > 0
    assert core.get_job(t1, 3.0).job.job_id == second.job.job_id
    with pytest.raises(UnknownWorker):                        # the dead target's late report
        core.job_ready(t0, grant.job.job_id, grant.job.generation, 0.0, 3.0)
    core.journal.flush()
    events = [e for e in read_journal(tmp_path) if isinstance(e, JobGivenBack)]
    assert sorted(e.job for e in events) == sorted([grant.job.job_id, second.job.job_id])
    assert all(e.was == "extracting" for e in events)
    assert core.counters.given_back["dead"] == 2
    # the run still completes exactly once with the survivor
    sim = Sim(core, [t1], [d0])
    sim.extracting[t1] = []
    for job_id in (grant.job.job_id, second.job.job_id):
        job = core.ledger.jobs[job_id]
        core.job_ready(t1, job_id, job.generation, 0.0, 3.0)
    sim.run()
    assert core.done
    assert sorted(sim.committed_ids()) == sorted(all_job_ids(core))


def test_leases_are_looked_at_once_a_second_and_a_lapsed_one_goes_back_within_it(tmp_path):
    core = make_core(tmp_path, epochs=1, worker_timeout_s=1000.0, lease_s=100.0)
    (t0,) = register(core, "target", 1)
    grant = core.get_job(t0, 0.0)
    assert core.sweep(99.9, is_alive=lambda w: True) == []  # looked at: not lapsed yet
    core.heartbeat(t0, 100.2)
    core.sweep(100.2, is_alive=lambda w: True)  # lapsed at 100.0, not looked at again before 100.9
    assert grant.job.state is JobState.EXTRACTING
    core.sweep(100.9, is_alive=lambda w: True)
    assert grant.job.state is JobState.PENDING


def test_silent_worker_times_out_and_expired_lease_is_given_back(tmp_path):
    core = make_core(tmp_path, epochs=1, worker_timeout_s=5.0, lease_s=11.0, min_ready=1)
    t0, t1 = register(core, "target", 2)
    (d0,) = register(core, "drafter", 1)
    grant = core.get_job(t0, 0.0)
    core.job_ready(t0, grant.job.job_id, grant.job.generation, 0.0, 0.0)
    hs, _ = core.get_hs(d0, 0.0)
    late = core.get_job(t1, 0.0)
    for worker in (t0, d0, t1):
        core.heartbeat(worker, 4.0)
    # A lease bounds how long one job may take: heartbeats keep the worker alive, not its jobs.
    assert late.job.lease_deadline == 11.0 and hs.job.lease_deadline == 11.0
    assert core.sweep(6.0, is_alive=lambda w: True) == []
    core.heartbeat(t0, 8.0)
    core.heartbeat(d0, 8.0)
    # t1 silent since 4.0: dead at 9.5; d0's training lease (deadline 11) still holds
    assert core.sweep(9.5, is_alive=lambda w: True) == ["t1.0"]
    assert late.job.state is JobState.PENDING
    assert hs.job.state is JobState.TRAINING
    core.heartbeat(t0, 12.0)
    core.heartbeat(d0, 12.0)
    # d0 alive but its lease ran out at 11.0: training -> ready, the slot still holds it
    assert core.sweep(12.5, is_alive=lambda w: True) == []
    assert hs.job.state is JobState.READY and core.pool.num_ready == 1
    assert sum(core.ledger.epochs[0].taken.values()) == 0
    with pytest.raises(LedgerError):
        core.consumed(d0, hs.job.job_id, 12.5)


def test_dead_drafter_gives_back_training_and_consumed_jobs(tmp_path):
    core = make_core(tmp_path, epochs=1, min_ready=1)
    (t0,) = register(core, "target", 1)
    d0, d1 = register(core, "drafter", 2)
    for _ in range(2):
        g = core.get_job(t0, 1.0)
        core.job_ready(t0, g.job.job_id, g.job.generation, 0.0, 1.0)
    a, _ = core.get_hs(d0, 1.0)
    core.consumed(d0, a.job.job_id, 1.0)
    b, _ = core.get_hs(d0, 1.0)
    assert core.sweep(2.0, is_alive=lambda w: w.id != "d0.0") == ["d0.0"]
    assert a.job.state is JobState.PENDING            # its step never completed: extract again
    assert b.job.state is JobState.READY              # the slot still holds it
    assert sum(core.ledger.epochs[0].taken.values()) == 0
    again, _ = core.get_hs(d1, 3.0)
    assert again.job.job_id == b.job.job_id
    assert core.ledger.peek_pending() == a.job.job_id


# -- min-ready reservoir and flush ----------------------------------------------------------------

def test_drafter_waits_for_min_ready_unless_the_epoch_drains(tmp_path):
    core = make_core(tmp_path, epochs=1, min_ready=3, credits=2)
    (t0,) = register(core, "target", 1)
    (d0,) = register(core, "drafter", 1)
    grants = [core.get_job(t0, 1.0) for _ in range(3)]
    assert grants[2] is None                              # credits: 2 at a time
    for g in grants[:2]:
        core.job_ready(t0, g.job.job_id, g.job.generation, 0.0, 1.0)
    assert core.pool.num_ready == 2
    assert core.get_hs(d0, 2.0) == (None, False)          # 2 < min_ready and 10 jobs still pending
    assert worker_state(core, core.workers[d0]) == "starved"
    g = core.get_job(t0, 2.0)
    core.job_ready(t0, g.job.job_id, g.job.generation, 0.0, 2.0)
    grant, flush = core.get_hs(d0, 3.0)
    assert grant is not None and grant not in (DONE,) and flush is False
    assert core.pool.num_ready == 2
    assert core.get_hs(d0, 3.0) == (None, False)


def test_drafter_is_served_below_min_ready_when_the_tail_drains(tmp_path):
    lengths = [10] * 8 + [100] * 4         # one job of bucket 0, one of bucket 1
    core = make_core(tmp_path, epochs=1, lengths=lengths, min_ready=3, credits=2)
    (t0,) = register(core, "target", 1)
    (d0,) = register(core, "drafter", 1)
    assert core.epoch_jobs[0] == 2
    first = core.get_job(t0, 1.0)
    core.job_ready(t0, first.job.job_id, first.job.generation, 0.0, 1.0)
    assert core.get_hs(d0, 1.0) == (None, False)          # one job still pending: keep the reservoir
    second = core.get_job(t0, 1.0)
    core.job_ready(t0, second.job.job_id, second.job.generation, 0.0, 1.0)
    taken = []
    for _ in range(2):
        grant, flush = core.get_hs(d0, 2.0)
        assert grant is not None and flush is False
        core.consumed(d0, grant.job.job_id, 2.0)
        taken.append(grant.job.job_id)
    assert sorted(taken) == [first.job.job_id, second.job.job_id]
    assert core.get_hs(d0, 2.0) == (None, True)           # nothing more is coming: commit what you hold
    core.commit_step(d0, taken, 0.0, 2.0)
    assert not core.done                                  # the model's last step is not checkpointed yet
    core.checkpoint(d0, 1, 2.0)
    assert core.done and core.get_hs(d0, 3.0) == (DONE, False) and core.get_job(t0, 3.0) == DONE


def test_flush_when_every_remaining_job_is_held_by_drafters(tmp_path):
    lengths = [10] * 16 + [100] * 8        # 2 jobs of bucket 0, 2 of bucket 1
    core = make_core(tmp_path, epochs=2, lengths=lengths, min_ready=1, credits=4)
    (t0,) = register(core, "target", 1)
    d0, d1 = register(core, "drafter", 2)
    grants = [core.get_job(t0, 1.0) for _ in range(4)]
    assert all(g is not None for g in grants) and len(core.epoch_jobs) == 1
    core.job_ready(t0, grants[0].job.job_id, grants[0].job.generation, 0.0, 1.0)
    held = []
    grant, flush = core.get_hs(d0, 1.0)
    assert flush is False
    held.append(grant.job.job_id)
    # jobs still extracting: no flush
    assert core.get_hs(d1, 1.0) == (None, False)
    for g in grants[1:]:
        core.job_ready(t0, g.job.job_id, g.job.generation, 0.0, 1.0)
    for _ in range(3):
        grant, flush = core.get_hs(d0, 2.0)
        assert flush is False
        held.append(grant.job.job_id)
    # epoch 0 is all with d0, but epoch 1 has not started yet: more is coming
    assert core.get_hs(d1, 2.0) == (None, False)
    for job_id in held:
        core.consumed(d0, job_id, 2.0)
    core.commit_step(d0, held[:2], 0.0, 2.0)
    # the target starts the last epoch and extracts all of it; d1 takes it all
    second = [core.get_job(t0, 3.0) for _ in range(4)]
    assert len(core.epoch_jobs) == 2 and all(g is not None and g.job.epoch == 1 for g in second)
    assert core.get_job(t0, 3.0) is None
    for g in second:
        core.job_ready(t0, g.job.job_id, g.job.generation, 0.0, 3.0)
    for _ in range(4):
        grant, flush = core.get_hs(d1, 3.0)
        assert grant is not None and flush is False
    # every remaining job is held by a drafter: both are told to flush
    assert core.get_hs(d0, 4.0) == (None, True)
    assert core.get_hs(d1, 4.0) == (None, True)
    assert core.nothing_left_to_hand_out()
    assert not core.done


# -- resume ---------------------------------------------------------------------------------------

def test_owner_slots_are_indexed_in_the_owners_memory_and_lost_with_it(tmp_path):
    core = make_core(tmp_path, epochs=1, shared_slots=0, min_ready=1, credits=2)
    t0 = core.register(role="target", name="a", pid=1, host="h", gpu=0, now=0.0).id
    core.register_slots(t0, {"h": 1}, 2, now=0.0)
    t1 = core.register(role="target", name="b", pid=2, host="h", gpu=1, now=0.0).id
    core.register_slots(t1, {"h": 2}, 2, now=0.0)
    (d0,) = register(core, "drafter", 1)
    assert core.workers[t1].slot_base == 2
    grants = {t: [core.get_job(t, 1.0) for _ in range(2)] for t in (t0, t1)}
    for t, gs in grants.items():
        assert sorted(g.slot for g in gs) == [0, 1]          # index inside the owner's own memory
        assert all(g.owner == t for g in gs)
        assert core.get_job(t, 1.0) is None                  # no slot of its own left, no shared one
        for g in gs:
            core.job_ready(t, g.job.job_id, g.job.generation, 0.0, 1.0)
    hs, _ = core.get_hs(d0, 2.0)
    assert hs.owner in (t0, t1) and hs.slot in (0, 1)
    assert hs.slot == next(g.slot for g in grants[hs.owner] if g.job.job_id == hs.job.job_id)
    owner = hs.owner
    other_ready = [g.job for g in grants[owner] if g.job.job_id != hs.job.job_id]
    assert core.sweep(3.0, is_alive=lambda w: w.id != owner) == [owner]
    # the ready job in the dead target's memory is extracted again
    assert other_ready[0].state is JobState.PENDING
    assert core.counters.given_back["slot_lost"] == 1
    # the job being trained from it goes back to pending when its drafter gives it back
    core.sweep(4.0, is_alive=lambda w: w.id != "d0.0")
    assert hs.job.state is JobState.PENDING
    survivor = t1 if owner == t0 else t0
    assert {s.owner for s in core.pool.slots.values()} == {survivor}


def test_a_schedule_without_jobs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="longer than the last bucket"):
        make_core(tmp_path, lengths=[1000, 2000])


def test_jobs_given_back_behind_a_full_pool_of_the_next_epoch_do_not_deadlock(tmp_path):
    # 2 slots. A drafter consumes the end of epoch 0, targets fill both slots with epoch 1, then the
    # drafter dies: its epoch-0 jobs are pending again but no slot is free for them.
    core = make_core(tmp_path, epochs=2, shared_slots=2, min_ready=0, credits=2)
    (t0,) = register(core, "target", 1)
    d0, d1 = register(core, "drafter", 2)
    epoch0 = core.ledger.epochs[0].num_jobs
    taken_by_d0 = []
    while len(taken_by_d0) < epoch0:
        grant = core.get_job(t0, 1.0)
        core.job_ready(t0, grant.job.job_id, grant.job.generation, 0.0, 1.0)
        hs, _ = core.get_hs(d0, 1.0)
        core.consumed(d0, hs.job.job_id, 1.0)
        taken_by_d0.append(hs.job.job_id)
    for _ in range(2):
        grant = core.get_job(t0, 2.0)
        assert grant.job.epoch == 1
        core.job_ready(t0, grant.job.job_id, grant.job.generation, 0.0, 2.0)
    assert core.get_job(t0, 2.0) is None          # blocked: both slots hold epoch-1 jobs
    core.sweep(3.0, is_alive=lambda w: w.id != d0)
    assert core.ledger.count(0, JobState.PENDING) == epoch0
    hs, _ = core.get_hs(d1, 3.0)
    assert hs is not None and hs.job.epoch == 1   # served to free a slot for epoch 0
    core.consumed(d1, hs.job.job_id, 3.0)
    grant = core.get_job(t0, 3.0)
    assert grant.job.epoch == 0                   # the given-back job comes first
    core.job_ready(t0, grant.job.job_id, grant.job.generation, 0.0, 3.0)
    hs2, _ = core.get_hs(d1, 3.0)
    assert hs2.job.epoch == 0                     # and epoch 0 is served again as soon as it is ready


def test_heartbeat_gives_back_a_dropped_job_but_not_one_whose_grant_is_still_on_its_way(tmp_path):
    core = make_core(tmp_path, epochs=1, credits=3)
    (t,) = register(core, "target", 1)
    first, second = core.get_job(t, 1.0), core.get_job(t, 1.0)
    assert (first.grant_seq, second.grant_seq) == (1, 2)
    core.heartbeat(t, 50.0, holding=[], seen_grant=0)       # neither grant has arrived yet: slow, not lost
    assert first.job.state is JobState.EXTRACTING and second.job.state is JobState.EXTRACTING
    core.heartbeat(t, 51.0, holding=[second.job.job_id], seen_grant=2)   # the first reply was lost
    assert core.ledger.state_of(first.job.job_id) is JobState.PENDING
    assert second.job.state is JobState.EXTRACTING
    assert core.counters.given_back["not_held"] == 1 and core.pool.counts()["quarantined"] == 0


def test_a_slot_whose_writer_lost_its_lease_is_quarantined_until_the_writer_is_gone(tmp_path):
    core = make_core(tmp_path, epochs=1, shared_slots=2, credits=1, lease_s=5.0)
    t0, t1 = register(core, "target", 2)
    late = core.get_job(t0, 1.0)
    core.heartbeat(t0, 7.0)
    core.sweep(7.0, is_alive=lambda w: True)                 # t0's lease lapsed, t0 itself still alive
    assert core.ledger.state_of(late.job.job_id) is JobState.PENDING
    assert core.pool.counts()["quarantined"] == 1
    again = core.get_job(t1, 7.0)                             # the job goes to t1, into the other slot
    assert again.job.job_id == late.job.job_id and again.slot != late.slot
    assert core.get_job(t0, 7.0) is None                      # t0's credit is still tied to the quarantined slot
    core.deregister(t0, 8.0)
    assert core.pool.counts()["quarantined"] == 0 and core.pool.counts()["free"] == 1


def test_a_worker_whose_capture_contract_differs_is_refused_naming_both(tmp_path):
    core = make_core(tmp_path, epochs=1)
    contract = CaptureContract(architecture="Qwen3ForCausalLM", num_layers=8, hidden_size=64, layer_ids=(1, 3, 5),
                               dtype="float32")
    core.register(role="target", name="target-0", pid=1, host="h", gpu=None, now=0.0, contract=contract)
    core.register(role="drafter", name="drafter-0", pid=2, host="h", gpu=None, now=0.0,
                  contract=CaptureContract.from_dict(contract.to_dict()))
    with pytest.raises(Incompatible) as refused:
        core.register(role="drafter", name="drafter-1", pid=3, host="h", gpu=None, now=0.0,
                      contract=msgspec.structs.replace(contract, layer_ids=(1, 4, 6)))
    message = str(refused.value)
    assert "this run" in message and "drafter drafter-1" in message and "[1, 3, 5]" in message and "[1, 4, 6]" in message


@pytest.mark.parametrize("batching", ["sorted", "fixed"])
def test_the_jobs_of_an_epoch_a_drafter_is_told_are_every_epochs_schedule(tmp_path, batching):
    """A drafter's learning-rate schedule spans run.epochs epochs of the count its register reply
    carries: the jobs of the first epoch's schedule, which every epoch's schedule makes, for any seed
    (what count_batches counts from the lengths alone)."""
    from core_harness import BUCKETS, TOKENS, small_lengths
    from common.run.records.schedule import build_epoch_schedule, count_batches
    from dispatcher.core import DispatcherCore
    from dispatcher.core_types import CoreOptions
    from dispatcher.journal import Journal
    from dispatcher.pool import HSPool
    lengths = small_lengths(seed=5, scale=3)
    options = CoreOptions(lease_s=1000.0, worker_timeout_s=1e6, epochs=3, run_seed=11, buckets=list(BUCKETS),
                          tokens_per_batch=TOKENS, order="interleave", batching=batching)
    pool = HSPool(min_ready=2, target_credits=2, pull="deficit", seed=1, num_buckets=len(BUCKETS))
    core = DispatcherCore(options, run_dir=tmp_path, lengths=lengths, journal=Journal(tmp_path), pool=pool,
                          shared_slots=6, now=0.0)
    jobs = core.store.jobs_per_epoch
    assert jobs == core.schedule(0).num_jobs == count_batches(lengths, bucket_max_lens=BUCKETS,
                                                               tokens_per_batch=TOKENS, batching=batching)
    for seed, epoch in ((11, 1), (11, 2), (4, 0)):
        assert build_epoch_schedule(lengths, bucket_max_lens=BUCKETS, tokens_per_batch=TOKENS, run_seed=seed,
                                    epoch=epoch, batching=batching).num_jobs == jobs
    if batching == "fixed":  # per bucket, its samples over the batch size of its longest: 8, 4, 2
        sizes = [sum(1 for n in lengths if lo < n <= hi) for lo, hi in zip([0, *BUCKETS], BUCKETS)]
        assert jobs == sum(-(-n // (TOKENS // hi)) for n, hi in zip(sizes, BUCKETS))


def test_samples_too_long_for_the_schedule_are_counted_in_the_log_stats_and_report(tmp_path, caplog):
    from common.wire.stats_snapshot import DroppedSamples
    from ops.report import build_report, format_report
    lengths = small_lengths() + [300, 3519, 257]  # the last bucket is 256: samples 50, 51 and 52 fit none
    with caplog.at_level("WARNING", logger="hsd.dispatcher"):
        core = make_core(tmp_path, lengths=lengths, epochs=1)
    assert any("3 of 53 samples are longer than the last bucket (256) and no epoch trains them: sample 50 "
               "(300 tokens), 51 (3519 tokens), 52 (257 tokens)" in r.getMessage() for r in caplog.records)
    assert build_snapshot(core, 0.0).dropped_samples == DroppedSamples(count=3, first=[50, 51, 52], longer_than=256)
    sim = Sim(core, register(core, "target", 1), register(core, "drafter", 1))
    sim.run()
    assert core.done and not set(load_schedule(tmp_path, 0).job_samples.tolist()) & {50, 51, 52}
    core.close()
    report = build_report(tmp_path)
    assert report["dropped_samples"] == {"count": 3, "first": [50, 51, 52], "longer_than": 256}
    assert ("dropped   3 sample(s) longer than the last bucket (256), in no epoch: sample 50, 51, 52"
            in format_report(report).splitlines())
    (tmp_path / "fits").mkdir()
    fits = make_core(tmp_path / "fits", epochs=1)
    assert fits.too_long.tolist() == [] and build_snapshot(fits, 0.0).dropped_samples is None
    fits.close()
