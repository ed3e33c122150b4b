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
