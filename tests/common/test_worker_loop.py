"""The one worker loop against a scripted dispatcher: prefetch, held jobs, commit-then-apply.

Real sockets, real shared memory, the real sim backends; the scripted dispatcher records when each
request arrived, which is what shows a request was sent ahead. Exactly-once is read from the sim
drafter's witness (its checkpoints), never from the loop's own counters.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch

from common.worker import loop as worker_loop
from drafter_worker import commit as drafter_commit
from common.wire.client import run_id_for
from common.wire.messages import ModelClaim, PendingCommit
from common.dataplane.slots import SlotView
from drafter_worker.loop import DrafterLoop
from drafter_worker.step_group import LoneGroup
from target_worker.loop import TargetLoop
from common.run.witness import latest_checkpoint
from drafter_worker.sim import SimDrafter
from loop_harness import FakeDispatcher, make_job, running, worker_config
from target_worker.sim import SimTarget

torch.set_num_threads(1)


@pytest.fixture
def fake(tmp_path):
    dispatcher = FakeDispatcher(f"ipc://{tmp_path / 'control.sock'}", run_id_for(tmp_path / "run"))
    yield dispatcher
    dispatcher.close()


def drafter(tmp_path, fake, *overrides: str, name: str = "drafter-0") -> DrafterLoop:
    config = worker_config(tmp_path / "run", fake.endpoint, *overrides)
    return DrafterLoop.from_config(config, name, SimDrafter(config.drafter, model_id=name, dataset_path=None))


def _index(fake, event) -> int:
    """Where ``event`` came in the fake's one stream of requests (it serves a single socket in order)."""
    return next(i for i, e in enumerate(fake.events) if e is event)


class SimDrafterHeldWhile(SimDrafter):
    """The sim drafter whose micro-batch of job ``job_id`` lasts until ``until(fake)`` holds: the
    test decides when the compute ends, not the machine's speed."""

    def __init__(self, config, model_id, fake, job_id, until):
        super().__init__(config.drafter, model_id=model_id, dataset_path=None)
        self.fake, self.job_id, self.until = fake, job_id, until

    def micro_batch(self, job, batch):
        if job.job_id == self.job_id:
            self.fake.wait_for(self.until, what="the condition the micro-batch waits on")
        super().micro_batch(job, batch)


def test_drafter_asks_for_its_next_job_while_computing_and_holds_both(tmp_path, fake):
    fake.add_ready_job(1, slot=0)
    fake.add_ready_job(2, slot=1)
    config = worker_config(tmp_path / "run", fake.endpoint)

    def job_2_listed_while_job_1_computes(f):
        consumed = f.ops("consumed")
        return consumed and [1, 2] in [e.request.holding for e in f.ops("heartbeat") if e.at > consumed[0].at]
    loop = DrafterLoop.from_config(config, "drafter-0", SimDrafterHeldWhile(config, "drafter-0", fake, 1,
                                                                job_2_listed_while_job_1_computes))
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 2, what="two committed steps")
        polls, commits = fake.ops("get_hs"), fake.ops("commit_step")
        consumed = fake.ops("consumed")
        # The get_hs that brought job 2 left before job 1's micro-batch began (its consumed) and so
        # before it finished (its commit).
        assert _index(fake, polls[1]) < _index(fake, consumed[0]) < _index(fake, commits[0])
        # While job 1 computed, the heartbeat listed job 2 too: a grant not yet looked at is held.
        during = [e.request.holding for e in fake.ops("heartbeat") if consumed[0].at < e.at < commits[0].at]
        assert [1, 2] in during
        # Once committed, nothing is held.
        fake.wait_for(lambda f: f.holding_after(f.ops("commit_step")[1].at) == [], what="an empty holding list")
    assert [c.request.step for c in commits] == [1, 2]
    assert [c.request.job_ids for c in commits] == [[1], [2]]
    assert loop.backend.step == 2 and list(loop.backend.trained) == [1, 2]


def test_a_drafter_whose_compute_hides_a_round_trip_sends_its_consumed_on_the_next_get_hs(tmp_path, fake):
    """Once a micro-batch has taken longer than CARRY_MIN_COMPUTE_S (the sim's sleep: 28 tokens at
    1 ms), the next get_hs waits until its slot is copied out and carries its consumed report; the
    first job, with no compute measured yet, keeps its poll in flight and reports on its own."""
    for job_id in range(1, 5):
        fake.add_ready_job(job_id, slot=job_id - 1)
    loop = drafter(tmp_path, fake, "drafter.sim_cost_per_token=0.001")
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 4, what="four committed steps")
        polls = fake.ops("get_hs")
    assert [p.request.consumed for p in polls[:5]] == [[], [], [2], [3], [4]]
    reports = fake.ops("consumed")
    assert [(r.request.job_id, r.carried) for r in reports] == [(1, False), (2, True), (3, True), (4, True)]
    for report in reports[1:]:  # each carried report came before the commit naming its job
        commit = next(c for c in fake.ops("commit_step") if report.request.job_id in c.request.job_ids)
        assert _index(fake, report) < _index(fake, commit)
    assert loop.backend.step == 4 and list(loop.backend.trained) == [1, 2, 3, 4]


def test_target_prefetches_its_second_job_and_lists_it_while_extracting(tmp_path, fake):
    fake.add_job(make_job(1, slot=0, generation=1))
    fake.add_job(make_job(2, slot=1, generation=1))
    config = worker_config(tmp_path / "run", fake.endpoint, "target.sim_cost_per_token=0.02")
    loop = TargetLoop.from_config(config, "target-0", SimTarget(config.target))
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("job_ready")) == 2, what="two ready jobs")
        polls, ready = fake.ops("get_job"), fake.ops("job_ready")
        assert polls[1].at < ready[0].at  # job 2 was asked for while job 1 was extracted
        assert [1, 2] in [e.request.holding for e in fake.ops("heartbeat") if e.at < ready[0].at]
    assert [r.request.job_id for r in ready] == [1, 2]
    assert ready[0].carried  # on the get_job sent as job 1 ended (job 2's grant was in by then)
    view = fake.arena.slot(1)
    assert view.read_header().job_id == 2  # the backend wrote the slot


def test_a_target_reports_a_slot_alone_when_its_next_get_job_waits(tmp_path, fake):
    """A job's ready report rides on the next get_job only when the one before is answered: with
    that one waiting (no job left), the report goes at once on its own, so the slot is never held
    back by a wait."""
    fake.add_job(make_job(1, slot=0, generation=1))
    fake.min_poll_wait_s = 3.0  # the prefetched get_job waits: no job comes
    config = worker_config(tmp_path / "run", fake.endpoint)
    loop = TargetLoop.from_config(config, "target-0", SimTarget(config.target))
    with running(loop):
        fake.wait_for(lambda f: f.ops("job_ready"), what="job 1 reported")
        polls, ready = fake.ops("get_job"), fake.ops("job_ready")
    assert [(r.request.job_id, r.carried) for r in ready] == [(1, False)]
    assert ready[0].at < polls[1].at + fake.min_poll_wait_s  # not after the wait
    assert all(not p.request.ready for p in polls)


def test_refused_commit_drops_the_step_and_forgets_its_jobs(tmp_path, fake):
    fake.commit_faults.extend(["refuse"])
    fake.add_ready_job(1, slot=0)
    loop = drafter(tmp_path, fake)
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 1, what="the refused commit")
        fake.wait_for(lambda f: f.holding_after(f.ops("commit_step")[0].at) == [], what="job 1 to leave the held set")
        fake.add_ready_job(2, slot=1)
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 2, what="the next commit")
    second = fake.ops("commit_step")[1].request
    assert (second.step, second.job_ids) == (1, [2])  # the refused step was never applied
    assert list(loop.backend.trained) == [2]


def test_unanswered_commit_is_sent_again_unchanged(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(drafter_commit, "CALL_TIMEOUT_S", 0.3)
    fake.commit_faults.extend(["silent"])
    fake.add_ready_job(1, slot=0)
    loop = drafter(tmp_path, fake)
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 2, what="the commit sent again")
        fake.wait_for(lambda f: f.holding_after(f.ops("commit_step")[-1].at) == [], what="job 1 committed")
    first, again = (c.request for c in fake.ops("commit_step"))
    assert (first.model, first.step, first.job_ids) == (again.model, again.step, again.job_ids)
    assert loop.backend.step == 1 and list(loop.backend.trained) == [1]


def test_a_lone_drafter_asked_to_stop_does_not_wait_for_an_unanswered_commit(tmp_path, fake, monkeypatch):
    """Asked to stop with its commit unanswered, a lone drafter does not keep sending it for
    RECONNECT_S (the other workers may give up on a dispatcher that comes back only once this one
    has gone): the step is dropped after one more try at most, and the stop saves the step applied."""
    monkeypatch.setattr(drafter_commit, "CALL_TIMEOUT_S", 0.3)
    fake.add_ready_job(1, slot=0)
    loop = drafter(tmp_path, fake)
    with running(loop):  # its exit must come within the 10 s it joins in
        fake.wait_for(lambda f: f.ops("commit_step") and f.holding_after(f.ops("commit_step")[-1].at) == [],
                      what="step 1 committed")
        fake.commit_faults.extend(["silent"] * 1000)
        fake.add_ready_job(2, slot=1)
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 2, what="the commit of step 2")
        loop.request_stop()
        sent_before_stop = len(fake.ops("commit_step"))
    assert 2 <= len(fake.ops("commit_step")) <= sent_before_stop + 1
    assert loop.backend.step == 1 and list(loop.backend.trained) == [1]
    assert latest_checkpoint(tmp_path / "run", loop.backend.model_id).step == 1


class SimDrafterWithFigures(SimDrafter):
    """The sim drafter with a trainer's step figures: loss = the step applied, an lr that is not finite."""

    def apply_step(self, job_ids):
        figures = super().apply_step(job_ids)
        self.last_metrics = {"loss": float(self.step), "tokens_per_s": 10.0, "lr": float("nan")}
        return figures


def test_a_steps_figures_go_with_the_next_commit_and_the_last_with_its_checkpoint(tmp_path, fake):
    for job_id in (1, 2):
        fake.add_ready_job(job_id, slot=job_id - 1)
    config = worker_config(tmp_path / "run", fake.endpoint)
    backend = SimDrafterWithFigures(config.drafter, model_id="drafter-0", dataset_path=None)
    loop = DrafterLoop.from_config(config, "drafter-0", backend)
    with running(loop) as thread:
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 2, what="two steps")
        fake.flush = True
        fake.wait_for(lambda f: f.ops("checkpoint"), what="the checkpoint of step 2")
        fake.done = True
        thread.join(10)
    first, second = (c.request for c in fake.ops("commit_step"))
    assert first.metrics is None  # nothing applied yet
    assert second.metrics == {"step": 1, "loss": 1.0, "tokens_per_s": 10.0}  # step 1's; the lr is not finite
    saved = fake.ops("checkpoint")[-1].request
    assert saved.step == 2 and saved.metrics == {"step": 2, "loss": 2.0, "tokens_per_s": 10.0}
    assert isinstance(loop.group, LoneGroup) and not torch.distributed.is_initialized()


def test_a_lone_drafter_is_a_group_of_one_that_opens_nothing():
    """No membership, rendezvous or store: the lone drafter's loop never loads the group's modules,
    so it never starts torch.distributed."""
    code = ("import sys, drafter_worker.loop, drafter_worker.sim, hsd.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('drafter_worker.process_group', "
            "'drafter_worker.elastic_group', 'drafter_worker.rendezvous', 'drafter_worker.state_transfer'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_forgetting_dispatcher_gets_a_new_registration_at_the_applied_step(tmp_path, fake):
    fake.add_ready_job(1, slot=0)
    loop = drafter(tmp_path, fake)
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 1, what="step 1")
        fake.commit_faults.extend(["forget"])
        fake.add_ready_job(2, slot=1)
        fake.wait_for(lambda f: len(f.ops("register")) == 2, what="a second registration")
        fake.add_ready_job(3, slot=2)
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 3, what="a commit after registering again")
    # the commit of step 2 the forgetting dispatcher never answered is named; it does not hold it: dropped
    assert fake.ops("register")[1].request.model == ModelClaim(id="drafter-0", step=1, checkpoint=0,
                                                               pending=PendingCommit(step=2, job_ids=[2]))
    assert fake.ops("commit_step")[2].request.step == 2
    assert list(loop.backend.trained) == [1, 3]


def test_flush_checkpoints_the_witness_and_a_restart_resumes_from_it(tmp_path, fake):
    for job_id in (1, 2, 3):
        fake.add_ready_job(job_id, slot=job_id - 1)
    fake.accum_steps = 2
    loop = drafter(tmp_path, fake)
    with running(loop) as thread:
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 1, what="a full step")
        fake.flush = True  # nothing more is coming: the partial step is committed, then checkpointed
        fake.wait_for(lambda f: f.ops("checkpoint"), what="a checkpoint")
        fake.done = True
        thread.join(10)
    assert [c.request.job_ids for c in fake.ops("commit_step")] == [[1, 2], [3]]
    saved = fake.ops("checkpoint")[-1].request
    assert (saved.model, saved.step) == ("drafter-0", 2)
    checkpoint = latest_checkpoint(tmp_path / "run", "drafter-0")
    assert checkpoint.step == 2 and list(checkpoint.trained_jobs()) == [1, 2, 3]

    fake.done, fake.flush = False, False
    again = drafter(tmp_path, fake)
    with running(again):
        fake.wait_for(lambda f: len(f.ops("register")) == 2, what="the restarted drafter")
    assert fake.ops("register")[1].request.model == ModelClaim(id="drafter-0", step=2, checkpoint=2)
    assert list(again.backend.trained) == [1, 2, 3]


def test_a_checkpoint_the_dispatcher_never_acknowledged_is_sent_again_after_registering_again(tmp_path, fake):
    fake.add_ready_job(1, slot=0)
    fake.flush = True  # nothing more is coming: the drafter checkpoints step 1
    fake.checkpoint_faults.append("forget")  # ... and the dispatcher restarts before acknowledging it
    loop = drafter(tmp_path, fake)
    with running(loop) as thread:
        fake.wait_for(lambda f: len(f.ops("checkpoint")) == 2, what="the checkpoint sent again")
        fake.done = True
        thread.join(10)
    # the register says the checkpoint it holds, and the report goes again (else no `done` would ever come)
    assert fake.ops("register")[1].request.model == ModelClaim(id="drafter-0", step=1, checkpoint=1)
    assert [c.request.step for c in fake.ops("checkpoint")] == [1, 1]


def test_stale_slot_is_reported_and_the_drafter_carries_on(tmp_path, fake, monkeypatch):
    fake.add_ready_job(1, slot=0, generation=1)
    job = make_job(2, slot=0, generation=7)  # the slot holds generation 1: a rewritten slot
    fake.add_job(job)
    fake.add_ready_job(3, slot=1)
    fake.add_ready_job(4, slot=2, generation=9)  # its writer starts again while the drafter copies it
    fake.add_ready_job(5, slot=3)
    check = SlotView.expect_generation

    def writer_starts_during_the_copy(view, generation, *, when="before"):
        header = check(view, generation, when=when)
        if generation == 9 and when == "before":
            view.begin_write()
        return header
    monkeypatch.setattr(SlotView, "expect_generation", writer_starts_during_the_copy)
    loop = drafter(tmp_path, fake)
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 3, what="three commits")
    failed = fake.ops("read_failed")
    assert [e.request.job_id for e in failed] == [2, 4]
    assert "stale slot" in failed[0].request.reason and "found 0 after" in failed[1].request.reason
    assert [e.request.job_id for e in fake.ops("consumed")] == [1, 3, 5]  # a stale copy never releases its slot
    assert list(loop.backend.trained) == [1, 3, 5]


def test_unanswered_poll_is_asked_again_on_a_fresh_socket(tmp_path, fake, monkeypatch, caplog):
    monkeypatch.setattr(worker_loop, "CALL_TIMEOUT_S", 0.2)
    fake.silent_polls = 1
    fake.add_ready_job(1, slot=0)
    loop = drafter(tmp_path, fake)
    with caplog.at_level(logging.WARNING, logger="hsd.worker"), running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 1, what="step 1")
    polls = fake.ops("get_hs")
    # asked again once, and only because the first poll timed out: the loop says so when its wait
    # for the reply ends unanswered, and sends the second poll after that
    asked_again = [r for r in caplog.records if "get_hs got no reply; asking again" in r.getMessage()]
    assert len(asked_again) == 1 and len(polls) >= 2
    assert list(loop.backend.trained) == [1]
    assert len(fake.ops("deregister")) == 1  # a clean stop leaves through deregister


def test_held_jobs_is_consistent_under_concurrent_writers():
    from common.worker.held_jobs import HeldJobs
    held = HeldJobs()

    def churn(base: int) -> None:
        for i in range(2000):
            held.add(base + i)
            if i % 2:
                held.discard([base + i - 1])

    threads = [threading.Thread(target=churn, args=(base,)) for base in (0, 10_000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = sorted({b + i for b in (0, 10_000) for i in range(2000) if i % 2})
    assert held.snapshot() == expected and len(held) == len(expected) and 1999 in held


def test_a_checkpoint_is_written_while_the_next_step_trains_and_reported_once_durable(tmp_path, fake):
    """The writer is held with step 1's files on disk, not yet published: the drafter trains and
    commits step 2 meanwhile, and the dispatcher hears of step 1 only once it is published."""
    for job_id in (1, 2, 3):
        fake.add_ready_job(job_id, slot=job_id - 1)
    fake.accum_steps = 1
    loop = drafter(tmp_path, fake, "drafter.checkpoint_every=1")
    release, held = threading.Event(), []

    def slow_writer(tmp, step):
        held.append(step)
        assert release.wait(30)
    loop.writer.before_publish = slow_writer
    with running(loop) as thread:
        try:
            fake.wait_for(lambda f: len(f.ops("commit_step")) == 2 and held == [1],
                          what="the commit of the step after the checkpoint, that checkpoint held")
            assert not fake.ops("checkpoint")
            assert latest_checkpoint(tmp_path / "run", "drafter-0") is None  # a crash now would keep no checkpoint
        finally:
            release.set()
        fake.wait_for(lambda f: [c.request.step for c in f.ops("checkpoint")][:2] == [1, 2], what="both checkpoints")
        fake.flush = True
        fake.wait_for(lambda f: f.ops("checkpoint")[-1].request.step == 3, what="the last checkpoint")
        fake.done = True
        thread.join(10)
    assert fake.ops("commit_step")[1].at < fake.ops("checkpoint")[0].at
    checkpoint = latest_checkpoint(tmp_path / "run", "drafter-0")
    assert checkpoint.step == 3 and list(checkpoint.trained_jobs()) == [1, 2, 3]


class DeferredSimTarget(SimTarget):
    """The sim target with its header published only by the returned write's ``wait()``: the shape of a GPU
    target whose slot copy is still on its side stream when ``extract`` returns."""

    def __init__(self, target):
        super().__init__(target)
        self.calls: list[tuple[str, int, float]] = []

    def extract(self, job, slot):
        super().extract(job, slot)
        header = slot.read_header()
        slot.begin_write()  # unpublished until wait()
        self.calls.append(("extract", job.job_id, time.monotonic()))
        calls = self.calls

        class Write:
            stream = None

            def wait(self):
                slot.write_header(header)
                calls.append(("wait", job.job_id, time.monotonic()))
        return Write()


def test_target_queues_its_next_job_before_it_waits_for_the_last_slot_copy(tmp_path, fake):
    fake.add_job(make_job(1, slot=0, generation=1))
    fake.add_job(make_job(2, slot=1, generation=1))
    config = worker_config(tmp_path / "run", fake.endpoint, "target.sim_cost_per_token=0.02")
    backend = DeferredSimTarget(config.target)
    loop = TargetLoop.from_config(config, "target-0", backend)
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("job_ready")) == 2, what="two ready jobs")
        ready = fake.ops("job_ready")
    # Job 2 was extracted before job 1's copy was waited for; job 2, with no job after it, is reported anyway.
    assert [(what, job) for what, job, _ in backend.calls] == [("extract", 1), ("extract", 2), ("wait", 1), ("wait", 2)]
    waited = {job: at for what, job, at in backend.calls if what == "wait"}
    assert [r.request.job_id for r in ready] == [1, 2]
    assert all(r.at >= waited[r.request.job_id] for r in ready)  # job_ready follows the copy's completion
    assert [fake.arena.slot(s).read_header().job_id for s in (0, 1)] == [1, 2]


def test_a_slow_copy_is_not_counted_as_compute(tmp_path, fake, monkeypatch):
    """The busy seconds a commit reports (what the step-cost model learns from) are the micro-batch's
    compute, not the wait for its slot's copy: on a GPU that wait leaves the compute stream idle."""
    from common.dataplane.slots import SlotCopy
    fake.add_ready_job(1, slot=0)
    wait = SlotCopy.wait

    def slow_wait(copy):
        time.sleep(0.4)
        return wait(copy)
    monkeypatch.setattr(SlotCopy, "wait", slow_wait)
    loop = drafter(tmp_path, fake)  # sim_cost_per_token=0: the micro-batch itself costs nothing
    with running(loop):
        fake.wait_for(lambda f: len(f.ops("commit_step")) == 1, what="a commit")
    assert fake.ops("commit_step")[0].request.busy_s < 0.2
