"""dispatcher/long_polls.py: parked polls tried again after a state change, in the order they were
parked; hundreds of parked drafters cost one look at the pool while no slot may be handed out."""

from core_harness import make_core, register
from common.wire import messages
from dispatcher.long_polls import LongPolls


def test_parked_drafters_cost_one_look_at_the_pool_while_none_can_be_served_and_are_served_in_order(tmp_path):
    core = make_core(tmp_path, shared_slots=8, min_ready=2)
    (target,), drafters = register(core, "target", 1), register(core, "drafter", 40)
    sent: list[tuple[bytes, messages.Reply]] = []
    polls = LongPolls(core, lambda identity, reply: sent.append((identity, reply)))
    for k, drafter in enumerate(drafters):
        reply, _ = polls.poll(drafter.encode(), messages.GetHS(id=k, worker_id=drafter, wait_ms=10_000), 1.0)
        assert reply is None  # nothing ready: parked
    looks = []
    serving_epoch = core.jobs.serving_epoch
    core.jobs.serving_epoch = lambda: looks.append(1) or serving_epoch()

    polls.serve(2.0)  # a state change that readied nothing
    assert sent == [] and len(looks) == 1  # asked once for all forty (once each before)
    assert all(core.workers[d].wait_reason == "starved" and core.workers[d].waiting_since == 1.0 for d in drafters)

    for _ in range(2):  # two slots ready: the reservoir (min_ready=2) lets one go
        grant = core.get_job(target, 3.0)
        core.job_ready(target, grant.job.job_id, grant.job.generation, 0.1, 3.0)
    polls.serve(3.0)
    assert [identity for identity, _ in sent] == [drafters[0].encode()]  # the first parked, first served
    assert sent[0][1].job is not None and len(polls.waiters) == 39
    assert len(looks) <= 4  # once before the grant, once after it, not once for each of the other 39


def test_a_newer_poll_replaces_the_parked_one_and_only_live_polls_expire_in_deadline_order(tmp_path):
    core = make_core(tmp_path, shared_slots=8, min_ready=2)
    drafters = register(core, "drafter", 3)
    sent: list[tuple[bytes, messages.Reply]] = []
    polls = LongPolls(core, lambda identity, reply: sent.append((identity, reply)))
    polls.poll(b"a", messages.GetHS(id=1, worker_id=drafters[0], wait_ms=1_000), 0.0)
    polls.poll(b"b", messages.GetHS(id=2, worker_id=drafters[1], wait_ms=3_000), 0.0)
    polls.poll(b"c", messages.GetHS(id=3, worker_id=drafters[2], wait_ms=2_000), 0.0)
    polls.poll(b"a", messages.GetHS(id=4, worker_id=drafters[0], wait_ms=5_000), 0.5)  # replaces id 1
    assert len(polls.waiters) == 3 and polls.next_deadline == 2.0  # id 1's deadline (1.0) is gone

    polls.expire(1.5)
    assert sent == []
    polls.expire(3.0)
    assert [(identity, reply.id) for identity, reply in sent] == [(b"c", 3), (b"b", 2)]
    assert all(reply.job is None for _, reply in sent)
    assert polls.next_deadline == 5.5 and [w.request.id for w in polls.waiters] == [4]

    polls.drop(drafters[0])
    assert polls.waiters == [] and polls.next_deadline == float("inf")
    polls.expire(10.0)
    assert len(sent) == 2  # a dropped poll goes unanswered


def test_a_poll_answered_at_once_takes_its_parked_predecessor_with_it(tmp_path):
    core = make_core(tmp_path, shared_slots=8)
    (target,) = register(core, "target", 1)
    sent: list[tuple[bytes, messages.Reply]] = []
    polls = LongPolls(core, lambda identity, reply: sent.append((identity, reply)))
    core.jobs.take_pending = lambda worker, now: None  # nothing to hand out: the first get_job parks
    reply, _ = polls.poll(b"t", messages.GetJob(id=1, worker_id=target, wait_ms=1_000), 0.0)
    assert reply is None and len(polls.waiters) == 1
    del core.jobs.take_pending  # jobs again
    reply, _ = polls.poll(b"t", messages.GetJob(id=2, worker_id=target, wait_ms=1_000), 0.1)
    assert reply is not None and reply.job is not None and reply.id == 2
    assert polls.waiters == [] and polls.next_deadline == float("inf")
    polls.serve(0.2)
    polls.expire(5.0)
    assert sent == []  # the worker gave up on id 1: it is neither served nor answered empty


def test_parked_targets_cost_one_look_while_no_slot_is_free_and_a_freed_slot_one_try(tmp_path):
    """Drafters slower than targets fill the pool, and every target's get_job parks: a state change
    must not try each of them (hundreds, at every consumed slot), only ask once whether any may be
    served, and a freed slot must cost one try, not one per parked target."""
    core = make_core(tmp_path, shared_slots=4, min_ready=1, credits=2)
    targets = register(core, "target", 32)
    writers, parked = targets[:2], targets[2:]
    (drafter,) = register(core, "drafter", 1)
    grants = [core.get_job(w, 1.0) for w in writers for _ in range(2)]  # 2 targets x 2 credits: every slot taken
    assert all(g.job is not None for g in grants) and not core.pool.has_free_slot()
    sent: list[tuple[bytes, messages.Reply]] = []
    polls = LongPolls(core, lambda identity, reply: sent.append((identity, reply)))
    for k, target in enumerate(parked):
        reply, _ = polls.poll(target.encode(), messages.GetJob(id=k, worker_id=target, wait_ms=10_000), 1.0)
        assert reply is None  # no free slot: parked
    tries = []
    take_pending = core.jobs.take_pending
    core.jobs.take_pending = lambda worker, now: tries.append(worker.id) or take_pending(worker, now)

    polls.serve(2.0)  # a state change that freed nothing
    assert sent == [] and tries == []
    assert all(core.workers[t].wait_reason == "blocked" and core.workers[t].waiting_since == 1.0 for t in parked)

    for grant in grants[:2]:  # two slots written, read and copied out: two free
        core.job_ready(writers[0], grant.job.job_id, grant.job.generation, 0.1, 3.0)
        taken, _ = core.get_hs(drafter, 3.0)
        core.consumed(drafter, taken.job.job_id, 3.0)
    polls.serve(3.0)
    assert [identity for identity, _ in sent] == [parked[0].encode(), parked[1].encode()]  # first parked, first served
    assert all(reply.job is not None for _, reply in sent) and tries == parked[:2]  # not 30 tries
    assert len(polls.waiters) == 28 and not core.pool.has_free_slot()
    assert all(core.workers[t].wait_reason == "blocked" for t in parked[2:])


def test_parked_ranks_share_one_look_while_their_group_stands_and_are_each_told_when_it_changes(tmp_path):
    """A data-parallel group of 24 ranks waits on a slow target: a state change that readies nothing
    must not try every rank's get_hs (each try costs what a lone drafter's does), a readied slot
    costs one try; while a rank waits to join, each is tried (a try opens the next version at a step
    boundary); once a member dies and its version ends, every parked rank is told at once."""
    core = make_core(tmp_path, shared_slots=8, credits=8, min_ready=0)
    (target,) = register(core, "target", 1)
    claim = messages.GroupClaim(size=24, min_ranks=1)
    ranks = [core.register(role="drafter", name=f"r{i}", pid=3000 + i, host="h", gpu=None, now=0.0,
                           model=messages.ModelClaim(id="m", step=0, group=claim)).id for i in range(24)]
    for rank in ranks:
        core.join_group(rank, 0.5, after=0, step=0)
    version = core.groups.groups["m"].version
    assert version == 1 and len(core.groups.groups["m"].members) == 24
    sent: list[tuple[bytes, messages.Reply]] = []
    polls = LongPolls(core, lambda identity, reply: sent.append((identity, reply)))
    for k, rank in enumerate(ranks):
        reply, _ = polls.poll(rank.encode(), messages.GetHS(id=k, worker_id=rank, wait_ms=10_000, membership=version), 1.0)
        assert reply is None  # nothing ready: parked
    tries = []
    get_hs = core.get_hs
    core.get_hs = lambda worker_id, now, **kw: tries.append(worker_id) or get_hs(worker_id, now, **kw)

    polls.serve(2.0)  # a state change that readied nothing
    assert sent == [] and tries == []
    assert all(core.workers[r].wait_reason == "starved" for r in ranks)

    for _ in range(2):  # two slots published: two tries, the first two parked ranks served
        grant = core.get_job(target, 3.0)
        core.job_ready(target, grant.job.job_id, grant.job.generation, 0.1, 3.0)
    polls.serve(3.0)
    assert [identity for identity, _ in sent] == [ranks[0].encode(), ranks[1].encode()] and tries == ranks[:2]
    assert all(reply.job is not None for _, reply in sent)

    sent.clear(), tries.clear()
    late = core.register(role="drafter", name="late", pid=3100, host="h", gpu=None, now=3.5,
                         model=messages.ModelClaim(id="m", step=0, group=claim)).id
    assert core.join_group(late, 3.5, after=0, step=0) is None  # it waits for the step boundary
    polls.serve(3.5)  # a rank waits to join: each parked get_hs is tried (it may open the next version)
    assert sorted(tries) == sorted(ranks[2:]) and sent == [] and core.groups.groups["m"].version == version

    tries.clear()
    core.deregister(ranks[23], 4.0, reason="dead")  # the version ends: a parked get_hs of it is void
    polls.drop(ranks[23])
    polls.serve(4.0)
    assert sorted(tries) == sorted(ranks[2:23]) and len(polls) == 0
    assert [identity for identity, _ in sent] == [r.encode() for r in ranks[2:23]]
    assert all(reply.error.code == messages.ErrorCode.GROUP_CHANGED for _, reply in sent)
