"""dispatcher/core.py across restarts of either side, judged by the models' own records (the witness).

The model is the source of truth for what was trained: a drafter registers with the step of the
state it holds and the ledger rolls back to exactly that step, whether or not the dispatcher
restarted.
"""

import json
import math
import zlib
from collections import Counter

import pytest

from common.run.witness import model_dir
from common.wire.messages import ModelClaim, PendingCommit
from core_harness import (Model, ModelSim, all_job_ids, make_core, register, register_models, small_lengths,
                          witness_counts)
from common.run.records.events import Checkpointed, ModelRolledBack, StepCommitted
from common.run.records.job_ids import make_job_id
from common.run.records.journal import read_journal
from dispatcher.core_types import DONE, UnknownWorker
from dispatcher.ledger import JobState, LedgerError


def restart(core, tmp_path, **kwargs):
    core.journal.close()
    core.close()
    return make_core(tmp_path, **kwargs)


def assert_exactly_once(core, models):
    assert core.done
    assert witness_counts(models) == Counter(all_job_ids(core))


def test_dispatcher_restart_while_drafters_keep_running(tmp_path):
    """Uncheckpointed commits survive a dispatcher restart: the drafters still hold them in their weights."""
    lengths = small_lengths(scale=4)
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=0)
    sim.run(until=lambda s: s.core.num_steps >= 4)
    assert all(m.ckpt_step == 0 for m in models) and sum(m.step for m in models) >= 4

    resumed = restart(core, tmp_path, lengths=lengths)
    assert resumed.ledger.epochs[0].committed == sum(len(m.trained) for m in models)   # nothing reverted
    sim2 = ModelSim(resumed, register(resumed, "target", 2), register_models(resumed, models), every=3)
    sim2.run()
    assert not [e for e in read_journal(tmp_path, only=(ModelRolledBack,)) if e.jobs]
    assert_exactly_once(resumed, models)


def test_drafter_restarts_from_an_older_checkpoint_while_the_dispatcher_runs(tmp_path):
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=small_lengths(scale=4))
    targets = register(core, "target", 2)
    sim = ModelSim(core, targets, register_models(core, models), every=3)
    sim.run(until=lambda s: models[0].step >= 5 and models[0].step % 3)
    lost = models[0].trained[len(models[0].ckpt_trained):]
    assert lost
    models[0].crash()                                       # back to its checkpoint at step 3
    (d,) = register_models(core, [models[0]])
    for job_id in lost:
        assert core.ledger.state_of(job_id) is JobState.PENDING
    assert core.ledger.model_step["m0"] == models[0].step
    others = {k: v for k, v in sim.models.items() if v is not models[0]}
    sim2 = ModelSim(core, targets, {**others, d: models[0]}, every=3)
    sim2.extracting, sim2.window = sim.extracting, {**{k: sim.window[k] for k in others}, d: []}
    sim2.run()
    assert_exactly_once(core, models)


def test_everything_crashes_and_resumes_from_checkpoints(tmp_path):
    lengths = small_lengths(scale=4)
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=2)
    sim.run(until=lambda s: s.core.num_steps >= 7)
    for m in models:
        m.crash()
    resumed = restart(core, tmp_path, lengths=lengths)
    sim2 = ModelSim(resumed, register(resumed, "target", 2), register_models(resumed, models), every=2)
    sim2.run()
    assert_exactly_once(resumed, models)


def test_a_model_ahead_of_the_ledger_is_refused(tmp_path):
    core = make_core(tmp_path, epochs=1)
    with pytest.raises(LedgerError, match="ahead of the ledger"):
        core.register(role="drafter", name="d", pid=1, host="h", gpu=None, now=0.0, model=ModelClaim(id="m", step=3))


def test_restart_of_a_finished_run_is_done(tmp_path):
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path)
    ModelSim(core, register(core, "target", 2), register_models(core, models)).run()
    assert core.done
    again = restart(core, tmp_path)
    assert again.done
    assert [again.ledger.epochs[e].committed for e in (0, 1)] == [12, 12]
    (t,) = register(again, "target", 1)
    (d,) = register_models(again, [models[0]])
    assert again.get_job(t, 0.0) == DONE and again.get_hs(d, 0.0) == (DONE, False)


def test_resume_after_the_second_epoch_started(tmp_path):
    """Commits in both epochs, then a crash of everything: each epoch keeps exactly its checkpointed jobs."""
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=2)
    sim.run(until=lambda s: any(j >= make_job_id(1, 0) for m in models for j in m.ckpt_trained))
    assert not core.done and len(core.epoch_jobs) == 2
    for m in models:
        m.crash()
    resumed = restart(core, tmp_path)
    sim2 = ModelSim(resumed, register(resumed, "target", 2), register_models(resumed, models), every=2)
    sim2.run()
    assert_exactly_once(resumed, models)


def test_snapshot_then_restart_replays_only_the_tail(tmp_path):
    lengths = small_lengths(scale=4)
    models = [Model("m0")]
    core = make_core(tmp_path, lengths=lengths)
    sim = ModelSim(core, register(core, "target", 2), register_models(core, models), every=1)
    sim.run(until=lambda s: s.core.num_steps >= 3)
    assert core.maybe_snapshot(force=True)
    core.close()
    sim.run(until=lambda s: s.core.num_steps >= 6)
    resumed = restart(core, tmp_path, lengths=lengths)
    assert resumed.ledger.epochs[0].committed == len(models[0].trained)
    assert resumed.ledger.model_step["m0"] == models[0].step
    sim2 = ModelSim(resumed, register(resumed, "target", 2), register_models(resumed, models))
    sim2.run()
    assert_exactly_once(resumed, models)


def test_worker_ids_differ_across_dispatcher_restarts(tmp_path):
    first = make_core(tmp_path, epochs=1)
    (old,) = register(first, "drafter", 1)
    first.journal.close()
    second = make_core(tmp_path, epochs=1)
    (new,) = register(second, "drafter", 1)
    assert old != new
    with pytest.raises(UnknownWorker):  # a request still naming the old id is not the new worker's
        second.get_hs(old, 1.0)


def test_a_checkpoint_said_at_register_ends_a_run_whose_report_was_lost(tmp_path):
    """A drafter's checkpoint became durable while no dispatcher listened, and every job is committed:
    nothing is left to train, so no checkpoint report will ever come. Its register says it."""
    lengths = small_lengths(scale=2)
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths, epochs=1)
    targets = register(core, "target", 2)
    ModelSim(core, targets, register_models(core, models), every=0, last_checkpoint=False).run(
        until=lambda s: s.core.all_committed)
    assert core.all_committed and not core.done       # no checkpoint reported
    for m in models:
        m.checkpoint()                                # written on the way out; the reports found no dispatcher
    resumed = restart(core, tmp_path, lengths=lengths, epochs=1)
    assert not resumed.done
    for i, m in enumerate(models):
        resumed.register(role="drafter", name=f"drafter-{m.id}", pid=3000 + i, host="h", gpu=None, now=0.0,
                         model=ModelClaim(id=m.id, step=m.step, checkpoint=m.ckpt_step))
    assert resumed.done
    assert [e.via for e in read_journal(tmp_path, only=(Checkpointed,))] == ["register", "register"]
    assert_exactly_once(resumed, models)


def test_a_checkpoint_said_at_register_is_never_past_the_ledger(tmp_path):
    core = make_core(tmp_path, epochs=1)
    with pytest.raises(ValueError, match="model.checkpoint"):   # past its own step: malformed, refused as decoded
        ModelClaim(id="m", step=0, checkpoint=2)
    m = Model("m")
    (d,) = register_models(core, [m])
    ModelSim(core, register(core, "target", 1), {d: m}, every=0).run(until=lambda s: m.step >= 2)
    core.register(role="drafter", name="d2", pid=2, host="h", gpu=None, now=0.0,
                  model=ModelClaim(id="m", step=m.step, checkpoint=m.step))
    assert core.checkpoints["m"] == m.step


def test_replay_lowers_the_known_checkpoint_on_a_rollback_as_the_live_path_does(tmp_path):
    """A drafter that comes back from an older checkpoint than the one last reported (the newer one
    lost) rolls the model back below it: a restarted dispatcher must know the same checkpoint."""
    lengths = small_lengths(scale=4)
    m = Model("m0")
    core = make_core(tmp_path, lengths=lengths)
    targets = register(core, "target", 2)
    sim = ModelSim(core, targets, register_models(core, [m]), every=2)
    sim.run(until=lambda s: m.step >= 4 and m.step == m.ckpt_step)
    known = core.checkpoints["m0"]
    m.step, m.trained, m.ckpt_step, m.ckpt_trained = 0, [], 0, []  # its checkpoints lost: it starts afresh
    register_models(core, [m])
    assert core.checkpoints["m0"] == 0 < known
    resumed = restart(core, tmp_path, lengths=lengths)
    assert resumed.checkpoints["m0"] == core.checkpoints["m0"] == 0


def test_a_model_no_drafter_comes_back_for_goes_back_to_its_checkpoint_and_the_run_ends(tmp_path):
    """A drafter stopped with steps past its last checkpoint and never came back (it stopped while no
    dispatcher answered its last commit, say): once every job is committed and no drafter has trained
    its model for dispatcher.abandoned_model_s, the model goes back to its checkpoint in the run
    directory, the live drafters train the jobs of its later steps, and the run ends with every job
    in one model."""
    lengths = small_lengths(scale=2)
    m0, m1 = models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths, epochs=1)
    drafters = register_models(core, models)
    d1 = next(d for d, m in drafters.items() if m is m1)
    sim = ModelSim(core, register(core, "target", 2), drafters, every=2)
    sim.run(until=lambda s: m1.step > m1.ckpt_step >= 2)
    left_at = sim.now
    core.sweep(left_at, lambda w: True)              # the last sweep that sees it live
    core.deregister(d1, left_at)                     # it stops; its last step is in no checkpoint
    sim.drafters.remove(d1)
    del sim.models[d1], sim.window[d1]
    model_dir(tmp_path, "m1").mkdir(parents=True)    # this run directory holds m1's checkpoints
    sim.run(until=lambda s: s.core.all_committed)
    assert core.all_committed and not core.done

    core.sweep(left_at + core.options.abandoned_model_s - 1, lambda w: True)
    assert not core.done and core.ledger.model_step["m1"] == m1.step   # it may still come back
    core.sweep(left_at + core.options.abandoned_model_s, lambda w: True)
    (rolled,) = [e for e in read_journal(tmp_path, only=(ModelRolledBack,)) if e.cause == "abandoned"]
    lost = m1.trained[len(m1.ckpt_trained):]
    assert (rolled.model, rolled.step, rolled.jobs) == ("m1", m1.ckpt_step, len(lost))
    assert core.ledger.model_step["m1"] == m1.ckpt_step and not core.all_committed
    assert all(core.ledger.state_of(job_id) is JobState.PENDING for job_id in lost)
    m1.crash()                                       # what it holds, should it ever come back
    sim.run()
    assert_exactly_once(core, models)


def test_a_run_that_is_not_done_says_what_it_waits_for(tmp_path):
    from dispatcher.snapshot import build_snapshot
    from ops.stats_view import waiting_lines
    lengths = small_lengths(scale=2)
    models = [Model("m0"), Model("m1")]
    core = make_core(tmp_path, lengths=lengths, epochs=1)
    targets = register(core, "target", 2)
    drafters = register_models(core, models)
    sim = ModelSim(core, targets, drafters, every=0, last_checkpoint=False)
    sim.run(until=lambda s: s.core.num_steps >= 2)
    waiting = build_snapshot(core, 1.0).waiting_for
    assert waiting.epochs["0"]["pending"] > 0 and waiting.reasons[0].startswith("epoch 1: ")
    sim.run(until=lambda s: s.core.all_committed)
    assert core.all_committed
    core.deregister(next(d for d, m in drafters.items() if m.id == "m1"), 2.0)
    waiting = build_snapshot(core, 2.0).waiting_for
    assert waiting.epochs == {} and set(waiting.models) == {"m0", "m1"}
    assert waiting.models["m0"].drafters == ["drafter-m0"] and waiting.models["m1"].drafters == []
    lines = waiting_lines(waiting)
    assert any("model m1" in line and "no live drafter trains it" in line for line in lines), lines
    assert any("waiting for drafter-m0 to checkpoint it" in line for line in lines), lines
    for d, m in drafters.items():
        if m.id == "m0":
            core.checkpoint(d, m.step, 3.0, model="m0")
    core.register(role="drafter", name="drafter-m1", pid=9, host="h", gpu=None, now=3.0,
                  model=ModelClaim(id="m1", step=models[1].step, checkpoint=models[1].step))
    assert core.done and build_snapshot(core, 3.0).waiting_for is None


def test_a_commit_whose_answer_was_lost_is_applied_when_the_ledger_holds_it(tmp_path):
    """The dispatcher died with a drafter's commit durable and unanswered: the drafter registers with
    the step it applied and the commit as pending; the ledger holds it, so the drafter applies it
    (no rollback). A pending commit the ledger does not hold is dropped."""
    lengths = small_lengths(scale=2)
    m = Model("m0")
    core = make_core(tmp_path, lengths=lengths, epochs=1)
    targets = register(core, "target", 1)
    sim = ModelSim(core, targets, register_models(core, [m]), every=0)
    sim.run(until=lambda s: m.step >= 3)
    last = core.ledger.last_commit["m0"]
    m.step, m.trained = m.step - 1, m.trained[:-len(last[1])]  # it never heard the answer: not applied
    resumed = restart(core, tmp_path, lengths=lengths, epochs=1)
    stale = resumed.register(role="drafter", name="other", pid=8, host="h", gpu=None, now=0.0,
                             model=ModelClaim(id="m1", step=0, pending=PendingCommit(step=1, job_ids=[1])))
    assert not stale.pending_committed
    w = resumed.register(role="drafter", name="drafter-m0", pid=9, host="h", gpu=None, now=0.0,
                         model=ModelClaim(id="m0", step=m.step,
                                                       pending=PendingCommit(step=last[0], job_ids=list(last[1]))))
    assert w.pending_committed and resumed.ledger.model_step["m0"] == last[0]
    assert not [e for e in read_journal(tmp_path, only=(ModelRolledBack,)) if e.jobs]


def test_a_segment_archived_without_its_snapshot_is_never_overwritten(tmp_path):
    """The dispatcher died between closing a journal segment and publishing the snapshot that covers
    it: the next one recovers from the previous snapshot and replays that segment, and its own next
    segment must get a new number — reusing it would replace acknowledged commits on disk."""
    lengths = small_lengths(scale=4)
    m = Model("m0")
    core = make_core(tmp_path, lengths=lengths)
    targets = register(core, "target", 1)
    sim = ModelSim(core, targets, register_models(core, [m]), every=0)
    sim.run(until=lambda s: m.step >= 2)
    assert core.maybe_snapshot(force=True)
    core.store.wait_for_snapshot()                      # snapshot of segment 0 published
    sim.run(until=lambda s: m.step >= 4)
    core.journal.rotate(core.store._segment + 1)        # segment 1 archived; its snapshot never published
    sim.run(until=lambda s: m.step >= 5)
    committed = [e.step for e in read_journal(tmp_path, only=(StepCommitted,))]
    resumed = restart(core, tmp_path, lengths=lengths)
    sim2 = ModelSim(resumed, register(resumed, "target", 1), register_models(resumed, [m]), every=0)
    sim2.run(until=lambda s: m.step >= 6)
    assert resumed.maybe_snapshot(force=True)
    resumed.store.wait_for_snapshot()
    assert [e.step for e in read_journal(tmp_path, only=(StepCommitted,))][:len(committed)] == committed
    again = restart(resumed, tmp_path, lengths=lengths)
    assert again.ledger.model_step["m0"] == m.step == 6


def _old_line(ev, t, **fields):
    """A journal line as the dispatcher wrote it before its events were typed: json.dumps of the merged
    map (``ev`` and ``t`` first, the keyword arguments after), compact, its crc32 in front."""
    body = json.dumps({"ev": ev, "t": t, **fields}, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def test_a_journal_written_before_the_typed_events_resumes(tmp_path):
    lengths = small_lengths(scale=1)
    first = make_core(tmp_path, lengths=lengths, epochs=1)  # the run directory: its schedule and data
    bucket = [int(b) for b in first.schedule(0).job_bucket]
    first.journal.close()
    first.close()
    j = [make_job_id(0, i) for i in range(len(bucket))]
    old = [
        _old_line("start", 1.0, resumed=False, committed=0),
        _old_line("epoch", 1.1, epoch=0, jobs=len(bucket), buckets=[3, 4, 5]),
        _old_line("revert", 1.2, steps=[]),  # a kind the first dispatchers wrote, long gone: skipped
        _old_line("join", 2.0, w="t0.0", role="target", name="target0", pid=1000, host="h", node="h"),
        _old_line("join", 2.0, w="d0.0", role="drafter", name="drafter-m", pid=2000, host="h", node="h"),
        *[_old_line("ready", 3.0 + i, job=j[i], w="t0.0", tokens=100, busy_s=0.5) for i in range(4)],
        *[_old_line("consumed", 4.0 + i, job=j[i], w="d0.0", bucket=bucket[i], **({"remote": 1} if i else {}))
          for i in range(4)],
        _old_line("give_back", 4.5, job=j[4], was="extracting", reason="lease_expired", w=None),
        _old_line("commit", 5.0, model="m", step=1, jobs=j[:2], w="d0.0", buckets=sorted(set(bucket[:2])), avail=2,
                  mixed=True, tokens=200, busy_s=0.25, verified=0),
        _old_line("checkpoint", 5.5, model="m", step=1, w="d0.0", metrics={"step": 1, "loss": math.nan}),
        _old_line("commit", 6.0, model="m", step=2, jobs=j[2:4], w="d0.0", buckets=sorted(set(bucket[2:4])),
                  avail=None, mixed=False, tokens=200, busy_s=0.25, verified=2, metrics={"step": 1, "loss": 2.5}),
        _old_line("rollback", 7.0, model="m", step=1, jobs=2, cause="restart"),  # step 2 was never checkpointed
        _old_line("checkpoint", 7.5, model="m", step=1, w=None, via="register"),
        _old_line("leave", 8.0, w="d0.0", reason="left"),
        _old_line("leave", 8.0, w="t0.0", reason="left"),
        _old_line("stop", 9.0, done=False, peak_slots=4, slot_bytes=4096),
    ]
    (tmp_path / "journal.jsonl").write_bytes(b"".join(old))
    assert len(list(read_journal(tmp_path))) == len(old) - 1  # each line decodes but the unknown kind's
    resumed = make_core(tmp_path, lengths=lengths, epochs=1)
    assert resumed.incarnation == 1  # the old journal's start counted
    assert resumed.ledger.model_step["m"] == 1 and resumed.checkpoints["m"] == 1
    assert [resumed.ledger.state_of(job) for job in j[:4]] == [JobState.COMMITTED] * 2 + [JobState.PENDING] * 2
    model = Model("m")
    model.step, model.trained = 1, j[:2]
    model.checkpoint()
    ModelSim(resumed, register(resumed, "target", 2), register_models(resumed, [model]), every=2).run()
    assert_exactly_once(resumed, [model])
