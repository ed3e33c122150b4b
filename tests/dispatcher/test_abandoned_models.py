"""Every model ends: one whose drafter is gone goes back to the step a resume would start from (its
newest whole checkpoint, step 0 with none), and a drafter that falls back past a damaged checkpoint
rolls its model back the same way: its later jobs are trained again, exactly once (the witness)."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from common.run.config import load_config
from common.run.witness import NoUsableCheckpoint, TrainedJobs, model_dir, save_checkpoint
from core_harness import Model, ModelSim, all_job_ids, make_core, register, register_models, small_lengths
from common.run.records.events import ModelRolledBack
from common.run.records.journal import read_journal
from dispatcher.ledger import JobState
from dispatcher.snapshot import build_snapshot
from drafter_worker.sim import SimDrafter


class DiskModel(Model):
    """A model whose checkpoints are written to the run directory, as a sim drafter writes them."""

    def __init__(self, model_id, run_dir):
        super().__init__(model_id)
        self.run_dir = run_dir

    def checkpoint(self):
        super().checkpoint()
        save_checkpoint(self.run_dir, self.id, self.step, TrainedJobs(self.trained))

    def resume(self):
        """The process restarted: what a real drafter loads from the run directory."""
        sim = SimDrafter(load_config(None, []).drafter, self.id, dataset_path=None)
        self.step = sim.load_latest(self.run_dir)
        self.trained = list(sim.trained)
        self.ckpt_step, self.ckpt_trained = self.step, list(self.trained)


def assert_exactly_once(core, models):
    assert core.done
    counts = Counter()
    for m in models:
        counts.update(m.trained)
    assert counts == Counter(all_job_ids(core))


def leave(core, sim, model, now):
    """The drafter of ``model`` is gone (SIGKILLed, or cut off and timed out): the last sweep saw it live."""
    d = next(d for d, m in sim.models.items() if m is model)
    core.sweep(now, lambda w: True)
    core.deregister(d, now)
    sim.drafters.remove(d)
    del sim.models[d], sim.window[d]


def abandoned(tmp_path):
    return [e for e in read_journal(tmp_path, only=(ModelRolledBack,)) if e.cause == "abandoned"]


def test_a_model_whose_drafter_is_lost_before_its_first_checkpoint_goes_back_to_step_0_and_the_run_ends(tmp_path):
    lengths = small_lengths(scale=2)
    m0, m1 = models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths, epochs=1)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=0)
    sim.run(until=lambda s: m1.step >= 2)
    left_at = sim.now
    leave(core, sim, m1, left_at)                     # no checkpoint of m1 anywhere, no models/m1/
    assert not model_dir(tmp_path, "m1").exists()
    sim.run(until=lambda s: s.core.all_committed)
    assert core.all_committed and not core.done and core.checkpoints.get("m1", 0) == 0 < m1.step
    (line,) = [r for r in build_snapshot(core, left_at).waiting_for.reasons if "model m1" in r]
    assert "no live drafter trains it" in line and "step 0: it has no checkpoint" in line, line

    core.sweep(left_at + core.options.abandoned_model_s - 1, lambda w: True)
    assert not abandoned(tmp_path) and core.ledger.model_step["m1"] == m1.step   # it may still come back
    core.sweep(left_at + core.options.abandoned_model_s, lambda w: True)
    (rolled,) = abandoned(tmp_path)
    assert (rolled.model, rolled.step, rolled.jobs) == ("m1", 0, len(m1.trained))
    assert all(core.ledger.state_of(job_id) is JobState.PENDING for job_id in m1.trained)
    m1.crash()                                        # what it holds, should it ever come back: nothing
    sim.run()
    assert_exactly_once(core, models)


def test_an_abandoned_model_goes_back_past_a_damaged_checkpoint_to_the_older_whole_one(tmp_path, caplog):
    lengths = small_lengths(scale=2)
    m0, m1 = models = [DiskModel("m0", tmp_path), DiskModel("m1", tmp_path)]
    core = make_core(tmp_path, lengths=lengths, epochs=1)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=2)
    sim.run(until=lambda s: m1.step > m1.ckpt_step >= 4)
    older_step = m1.ckpt_step - 2
    left_at = sim.now
    leave(core, sim, m1, left_at)
    witness = model_dir(tmp_path, "m1") / f"step-{m1.ckpt_step:08d}" / "trained_jobs.bin"
    data = bytearray(witness.read_bytes())
    data[len(data) // 2] ^= 0x10
    witness.write_bytes(bytes(data))                  # its newest checkpoint, reported, is damaged
    sim.run(until=lambda s: s.core.all_committed)
    with caplog.at_level(logging.WARNING):
        core.sweep(left_at + core.options.abandoned_model_s, lambda w: True)
    (rolled,) = abandoned(tmp_path)
    assert (rolled.model, rolled.step) == ("m1", older_step)
    assert core.checkpoints["m1"] == older_step
    assert sum(str(witness) in r.getMessage() for r in caplog.records) == 1
    m1.resume()                                       # should it come back, it loads the same older one
    assert m1.step == older_step
    sim.run()
    assert_exactly_once(core, models)


def test_a_drafter_that_falls_back_past_a_damaged_checkpoint_rolls_its_model_back_and_nothing_is_lost(tmp_path):
    """Its steps past the older checkpoint were acknowledged: they go back to pending when it
    registers from there (the restart path) and are trained again, once."""
    lengths = small_lengths(scale=4)
    m0, m1 = models = [DiskModel("m0", tmp_path), DiskModel("m1", tmp_path)]
    core = make_core(tmp_path, lengths=lengths)
    targets = register(core, "target", 2)
    sim = ModelSim(core, targets, register_models(core, models), every=3)
    sim.run(until=lambda s: m1.step > m1.ckpt_step >= 6)
    older_step = m1.ckpt_step - 3
    newest = model_dir(tmp_path, "m1") / f"step-{m1.ckpt_step:08d}" / "trained_jobs.bin"
    newest.write_bytes(newest.read_bytes()[:-8])                     # cut short
    leave(core, sim, m1, sim.now)
    trained_before = list(m1.trained)
    m1.resume()                                                      # what a restarted drafter loads
    assert m1.step == older_step
    again = trained_before[len(m1.trained):]                         # acknowledged, in no whole checkpoint
    (d,) = register_models(core, [m1], now=sim.now)
    assert core.ledger.model_step["m1"] == older_step
    assert all(core.ledger.state_of(j) is JobState.PENDING for j in again)
    (rolled,) = [e for e in read_journal(tmp_path, only=(ModelRolledBack,)) if e.model == "m1" and e.jobs]
    assert (rolled.step, rolled.jobs, rolled.cause) == (older_step, len(again), "restart")
    sim2 = ModelSim(core, targets, {**sim.models, d: m1}, every=3)
    sim2.extracting, sim2.window = sim.extracting, {**sim.window, d: []}
    sim2.run()
    assert_exactly_once(core, models)


def test_a_dispatcher_refuses_to_start_a_run_whose_model_has_no_whole_checkpoint(tmp_path, caplog):
    """The only copy of the model's acknowledged commits is damaged: refused, naming the file and what
    to do, before any worker starts (hsd exits 2). A damaged newest one beside a whole older one is
    said and passed over."""
    save_checkpoint(tmp_path, "m0", 3, TrainedJobs([1, 2]))
    save_checkpoint(tmp_path, "m1", 2, TrainedJobs([5]))
    save_checkpoint(tmp_path, "m1", 4, TrainedJobs([5, 6]))
    step_file = model_dir(tmp_path, "m1") / "step-00000004" / "step.json"
    step_file.write_text(step_file.read_text().replace('"m1"', '"m2"'))
    with caplog.at_level(logging.WARNING):
        core = make_core(tmp_path, epochs=1)
    core.journal.close()
    core.close()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert str(step_file) in line and "step 2" in line, line
    witness = model_dir(tmp_path, "m0") / "step-00000003" / "trained_jobs.bin"
    witness.write_bytes(witness.read_bytes()[:-1])
    with pytest.raises(NoUsableCheckpoint, match=f"{witness}: 15 bytes, its manifest says 16.*move .*m0 aside"):
        make_core(tmp_path, epochs=1)
