"""Finished epochs leave memory: once a snapshot holds one, its arrays are read-only mappings of the
snapshot's files, later snapshots hard-link those files instead of copying them, and a rollback that
reaches into a sealed epoch copies it back first. Judged by the models' own witness.
"""

import os
from collections import Counter

import numpy as np

from core_harness import Model, ModelSim, all_job_ids, make_core, register, register_models, small_lengths, \
    witness_counts
from common.run.records.job_ids import make_job_id
from dispatcher.ledger import NOT_COMMITTED, JobLedger, JobState, LedgerError
from dispatcher.recovery import array_file, latest_snapshot_dir


def _finish_epoch_zero(ledger: JobLedger) -> None:
    """Epoch 0 (4 jobs) committed by model a at steps 1-2 and model b at step 1."""
    for step, (model, job_ids) in enumerate([("a", [0, 1]), ("b", [2]), ("a", [3])]):
        for job_id in job_ids:
            job = ledger.start_extract("t", slot=job_id, generation=1, now=0.0, lease_s=10.0)
            ledger.mark_ready(job.job_id, "t", 1)
            ledger.start_training(job.job_id, "d", 0.0, 10.0)
            ledger.mark_consumed(job.job_id, "d")
        ledger.commit(job_ids, "d", model, ledger.model_step.get(model, 0) + 1)


def _seal(ledger: JobLedger, epoch: int) -> None:
    progress = ledger.epochs[epoch]
    frozen = [np.array(a) for a in (progress.commit_step, progress.commit_model)]
    for a in frozen:
        a.flags.writeable = False  # as a read-only mapping would be
    ledger.seal_epoch(epoch, *frozen, np.array(progress.job_bucket))


def test_a_rollback_that_cannot_reach_a_sealed_epoch_leaves_it_sealed():
    ledger = JobLedger()
    ledger.add_epoch(0, [0, 1, 0, 1])
    ledger.add_epoch(1, [0, 0])
    _finish_epoch_zero(ledger)
    _seal(ledger, 0)
    progress = ledger.epochs[0]
    assert progress.sealed and progress.latest_step == {0: 2, 1: 1}
    assert ledger.state_of(make_job_id(0, 3)) is JobState.COMMITTED
    assert ledger.rollback("a", 2) == [] and ledger.rollback("b", 1) == []
    assert progress.sealed and not progress.commit_step.flags.writeable


def test_a_rollback_into_a_sealed_epoch_unseals_it_and_reverts_exactly_the_later_steps():
    ledger = JobLedger()
    ledger.add_epoch(0, [0, 1, 0, 1])
    _finish_epoch_zero(ledger)
    _seal(ledger, 0)
    assert ledger.rollback("a", 1) == [make_job_id(0, 3)]
    progress = ledger.epochs[0]
    assert not progress.sealed and progress.commit_step.flags.writeable and progress.state.flags.writeable
    assert progress.committed == 3 and ledger.count(0, JobState.PENDING) == 1
    assert progress.commit_step.tolist() == [1, 1, 1, NOT_COMMITTED]
    assert ledger.peek_pending() == make_job_id(0, 3)


def test_an_open_epoch_cannot_be_sealed():
    ledger = JobLedger()
    ledger.add_epoch(0, [0, 1])
    try:
        _seal(ledger, 0)
    except LedgerError as exc:
        assert "not finished" in str(exc)
    else:
        raise AssertionError("sealed an open epoch")


def _snapshot_and_seal(core):
    """What the server's sweep does every 0.25 s, made synchronous: snapshot, wait, seal."""
    core.maybe_snapshot()
    core.store.wait_for_snapshot()


def test_finished_epochs_are_sealed_linked_and_reopened_by_an_older_checkpoint(tmp_path):
    lengths = small_lengths(scale=3)
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths, epochs=3)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=1)
    old = {}

    def until(s):
        _snapshot_and_seal(s.core)
        if not old and models[0].step >= 2:
            old.update(step=models[0].step, trained=list(models[0].trained))  # a checkpoint kept back
        return s.core.ledger.epochs[0].sealed and 1 in s.core.ledger.epochs and s.core.ledger.epochs[1].committed

    sim.run(until=until)
    progress = core.ledger.epochs[0]
    assert progress.sealed and not progress.commit_step.flags.writeable
    sealed_file = latest_snapshot_dir(tmp_path) / array_file("commit_step", 0)
    inode = os.stat(sealed_file).st_ino
    assert np.array_equal(np.load(sealed_file), progress.commit_step)
    core.maybe_snapshot(force=True)
    core.store.wait_for_snapshot()
    relinked = latest_snapshot_dir(tmp_path) / array_file("commit_step", 0)
    assert relinked != sealed_file and os.stat(relinked).st_ino == inode  # linked, not written again

    # m0 restarts from a checkpoint taken in epoch 0: the rollback reaches into the sealed epoch
    m0 = models[0]
    m0.step, m0.trained = old["step"], list(old["trained"])
    m0.checkpoint()
    (d,) = register_models(core, [m0])
    assert not core.ledger.epochs[0].sealed and core.ledger.count(0, JobState.PENDING) > 0
    others = {k: v for k, v in sim.models.items() if v is not m0}
    sim2 = ModelSim(core, sim.targets, {**others, d: m0}, every=1)
    sim2.extracting, sim2.window = sim.extracting, {**{k: sim.window[k] for k in others}, d: []}
    sim2.run(until=lambda s: (_snapshot_and_seal(s.core), False)[1], max_rounds=2000)
    assert core.done
    assert witness_counts(models) == Counter(all_job_ids(core))
    _snapshot_and_seal(core)
    assert all(p.sealed for p in core.ledger.epochs.values())
    committed = {e: np.array(p.commit_step) for e, p in core.ledger.epochs.items()}
    core.journal.close()
    core.close()

    resumed = make_core(tmp_path, lengths=lengths, epochs=3)  # a restart maps the sealed epochs back
    assert resumed.done
    assert all(p.sealed for p in resumed.ledger.epochs.values())
    for epoch, steps in committed.items():
        assert np.array_equal(resumed.ledger.epochs[epoch].commit_step, steps)
    resumed.journal.close()
    resumed.close()
