"""dispatcher/core.py across restarts: a new core on the same run directory resumes from the journal."""

from collections import Counter

import pytest

from core_harness import Sim, all_job_ids, make_core, register, small_lengths
from dispatcher.core import DONE, UnknownWorker
from dispatcher.journal import read_journal
from dispatcher.ledger import JobState, make_job_id

def restart(core, tmp_path, **kwargs):
    core.journal.close()
    return make_core(tmp_path, **kwargs)


def test_resume_keeps_committed_and_nothing_else(tmp_path):
    lengths = small_lengths(scale=4)       # 48 jobs per epoch: the restart comes within the first
    core = make_core(tmp_path, lengths=lengths)
    targets, drafters = register(core, "target", 2), register(core, "drafter", 2)
    sim = Sim(core, targets, drafters)
    sim.run(until=lambda s: len(s.commits) >= 2)
    kept = set(sim.committed_ids())
    sim.checkpointed = False
    sim.run(until=lambda s: len(s.commits) >= 4)
    lost = set(sim.committed_ids()) - kept
    assert lost and len(core.schedules) == 1
    states_before = Counter(j.state for j in core.ledger.jobs.values())
    assert states_before[JobState.READY] + states_before[JobState.EXTRACTING] > 0
    schedule = core.schedules[0]

    resumed = restart(core, tmp_path, lengths=lengths)
    assert resumed.schedules[0] == schedule                    # read back, never re-drawn
    assert set(resumed.schedules) == {0}
    for job_id, job in resumed.ledger.jobs.items():
        expected = JobState.COMMITTED if job_id in kept else JobState.PENDING
        assert job.state is expected, job_id
    assert resumed.ledger.epochs[0].committed == len(kept)
    assert resumed.next_step == len(sim.commits)               # step numbers go on
    reverts = [e for e in read_journal(tmp_path) if e["ev"] == "revert"]
    assert len(reverts) == 1 and sorted(reverts[0]["steps"]) == [2, 3]
    assert resumed.pool.counts()["free"] == 6 and resumed.pool.num_ready == 0

    # the resumed run finishes: every job committed exactly once counting the kept commits
    targets, drafters = register(resumed, "target", 2), register(resumed, "drafter", 2)
    sim2 = Sim(resumed, targets, drafters)
    sim2.run()
    assert resumed.done
    assert Counter(kept) + Counter(sim2.committed_ids()) == Counter(all_job_ids(resumed))
    assert min(step for step, _, _ in sim2.commits) == 4


def test_restart_of_a_finished_run_is_done(tmp_path):
    core = make_core(tmp_path)
    sim = Sim(core, register(core, "target", 2), register(core, "drafter", 2))
    sim.run()
    assert core.done
    again = restart(core, tmp_path)
    assert again.done
    assert all(job.state is JobState.COMMITTED for job in again.ledger.jobs.values())
    assert [again.ledger.epochs[e].committed for e in (0, 1)] == [12, 12]
    (t,) = register(again, "target", 1)
    (d,) = register(again, "drafter", 1)
    assert again.get_job(t, 0.0) == DONE and again.get_hs(d, 0.0) == (DONE, False)


def test_restart_of_a_finished_one_epoch_run_is_done(tmp_path):
    core = make_core(tmp_path, epochs=1)
    sim = Sim(core, register(core, "target", 2), register(core, "drafter", 2))
    sim.run()
    assert core.done
    again = restart(core, tmp_path, epochs=1)
    assert again.done and len(again.schedules) == 1
    (t,) = register(again, "target", 1)
    assert again.get_job(t, 0.0) == DONE


def test_resume_after_the_second_epoch_started(tmp_path):
    """Commits in both epochs, then a restart: each epoch keeps exactly its own committed jobs."""
    core = make_core(tmp_path)
    targets, drafters = register(core, "target", 2), register(core, "drafter", 2)
    sim = Sim(core, targets, drafters)
    sim.run(until=lambda s: any(j >= make_job_id(1, 0) for j in s.committed_ids()))
    assert not core.done and len(core.schedules) == 2
    kept = set(sim.committed_ids())
    per_epoch = Counter(core.ledger.jobs[j].epoch for j in kept)

    resumed = restart(core, tmp_path)
    for job_id, job in resumed.ledger.jobs.items():
        assert job.state is (JobState.COMMITTED if job_id in kept else JobState.PENDING), job_id
    for epoch in (0, 1):
        assert resumed.ledger.epochs[epoch].committed == per_epoch[epoch]
        assert sum(resumed.ledger.epochs[epoch].taken.values()) == per_epoch[epoch]
    targets, drafters = register(resumed, "target", 2), register(resumed, "drafter", 2)
    sim2 = Sim(resumed, targets, drafters)
    sim2.run()
    assert resumed.done
    assert Counter(kept) + Counter(sim2.committed_ids()) == Counter(all_job_ids(resumed))


def test_resume_with_second_epoch_started_but_only_first_epoch_commits_finishes(tmp_path):
    core = make_core(tmp_path)
    targets, drafters = register(core, "target", 2), register(core, "drafter", 2)
    sim = Sim(core, targets, drafters)
    sim.run(until=lambda s: len(s.core.schedules) == 2 and s.commits)
    assert not any(j >= make_job_id(1, 0) for j in sim.committed_ids())
    kept = set(sim.committed_ids())
    assert kept

    resumed = restart(core, tmp_path)
    assert resumed.ledger.epochs[1].committed == 0
    assert not resumed.ledger.epoch_complete(1)
    targets, drafters = register(resumed, "target", 2), register(resumed, "drafter", 2)
    sim2 = Sim(resumed, targets, drafters)
    sim2.run()
    assert resumed.done
    assert Counter(kept) + Counter(sim2.committed_ids()) == Counter(all_job_ids(resumed))


# -- targets that own their slots (cuda_ipc) -------------------------------------------------------


def test_worker_ids_differ_across_dispatcher_restarts(tmp_path):
    first = make_core(tmp_path, epochs=1)
    (old,) = register(first, "drafter", 1)
    first.journal.close()
    second = make_core(tmp_path, epochs=1)
    (new,) = register(second, "drafter", 1)
    assert old != new
    with pytest.raises(UnknownWorker):  # a request still naming the old id is not the new worker's
        second.get_hs(old, 1.0)
