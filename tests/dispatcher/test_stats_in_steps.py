"""Stats snapshots built a step a turn of the loop: the snapshot in steps shows what the whole one
shows; on the stats socket, requests that arrive meanwhile are answered first, the reply goes out
once the last step is done, and a dispatcher that stops tells a stats request still waiting (driven
on the built dispatcher, no poller, its replies captured)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgspec
import pytest

from common.run.config import load_config
from common.wire import messages
from core_harness import Sim, make_core, register
from dispatcher import server as server_module
from dispatcher.build import build_dispatcher
from dispatcher.snapshot import build_snapshot, snapshot_steps


@pytest.fixture
def server(monkeypatch):
    with tempfile.TemporaryDirectory(prefix="hsd-steps-", dir="/tmp") as short:  # ipc paths stay short
        config = load_config(None, [
            f"run.dir={short}/run", "data.synthetic_samples=400", "schedule.tokens_per_batch=1024",
            "schedule.buckets=[256,512,1024]", "target.hidden_size=1", "target.num_capture_layers=1",
            "pool.transport=shm", "pool.slots=8", "pool.min_ready=0", "dispatcher.exit_when_done=false",
            f"dispatcher.endpoint=ipc://{short}/c", f"dispatcher.stats_endpoint=ipc://{short}/s"])
        built = build_dispatcher(config)
        sent: list[tuple[str, bytes, messages.Reply]] = []
        monkeypatch.setattr(server_module, "send_reply",
                            lambda sock, identity, reply: sent.append(("stats" if sock is built.stats else "control",
                                                                       identity, reply)))
        monkeypatch.setattr(server_module, "SNAPSHOT_WORKERS_A_STEP", 3)
        built.sent = sent
        try:
            yield built
        finally:
            built.close()


def _control(server, identity: bytes, request: messages.Request) -> messages.Reply:
    request.id = 1
    reply, _ = server._handle_control(identity, [messages.encode(request)])
    assert reply is not None
    return reply


def test_a_stats_snapshot_is_built_in_steps_while_requests_are_answered(server):
    workers = [_control(server, f"t{i}".encode(), messages.Register(role="target", name=f"t{i}", pid=10 + i,
                                                                     host="h")) for i in range(10)]
    reply, _ = server._handle_stats(b"watcher", [messages.encode(messages.Stats(id=7))])
    assert reply is None and server.sent == []  # building: 10 workers, 3 a step

    server._build_step()  # the first three workers
    beat = messages.Heartbeat(holding=[], seen_grant=0, worker_id=workers[0].worker_id, token=workers[0].token)
    assert isinstance(_control(server, b"t0", beat), messages.Done)  # answered while the snapshot is built
    late = _control(server, b"late", messages.Register(role="target", name="late", pid=99, host="h"))

    for _ in range(4):  # three more steps of workers, one for the rest of the snapshot
        server._build_step()
    assert server.sent == []
    server._build_step()  # the per-node view: done
    [(socket, identity, stats)] = server.sent
    assert (socket, identity, stats.id) == ("stats", b"watcher", 7) and not server._builds
    assert len(stats.stats.workers) == 10 and late.worker_id not in {w.id for w in stats.stats.workers}

    reply, _ = server._handle_stats(b"watcher", [messages.encode(messages.Heartbeat(id=8, worker_id="x", holding=[], seen_grant=0))])
    assert reply.error.code == messages.ErrorCode.READ_ONLY  # refused at once, nothing built


def test_a_stats_request_still_waiting_when_the_dispatcher_stops_is_told(server):
    server._handle_stats(b"watcher", [messages.encode(messages.Stats(id=9))])
    server._build_step()
    server.close()
    [(socket, identity, reply)] = [s for s in server.sent if s[0] == "stats"]
    assert identity == b"watcher" and reply.id == 9 and "stopping" in reply.error.message


def test_the_snapshot_built_in_steps_shows_what_the_whole_one_shows(tmp_path):
    """/metrics builds its snapshot a few hundred workers at a time, the loop serving requests in
    between: the result is the snapshot built at once (times aside), and a worker that leaves
    between two steps does not break it."""
    core = make_core(tmp_path)
    targets, drafters = register(core, "target", 6), register(core, "drafter", 4)
    Sim(core, targets, drafters).run(max_rounds=6)  # jobs held, ready, committed
    whole = build_snapshot(core, 1.0)
    assert any(w.held for w in whole.workers) and whole.steps > 0
    steps = snapshot_steps(core, workers_a_step=3)
    yields = 0
    try:
        while True:
            next(steps)
            yields += 1
    except StopIteration as built:
        stepped = built.value
    assert yields == 4  # 10 workers, 3 a step: 4 steps, then the rest

    def without_times(snapshot):
        out = msgspec.to_builtins(snapshot)
        for key in ("time", "uptime_s"):
            out.pop(key)
        for w in out["workers"]:
            for key in ("heartbeat_age_s", "alive_s", "wait_s", "idle_ratio", "tokens_per_s"):
                w.pop(key, None)
        return out

    assert without_times(stepped) == without_times(whole) and len(stepped.workers) == 10

    steps = snapshot_steps(core, workers_a_step=4)
    next(steps)
    core.deregister(targets[5], 2.0)  # in the second step's share: shown once more, holding nothing
    next(steps), next(steps)
    with pytest.raises(StopIteration) as built:
        next(steps)
    left = [w for w in built.value.value.workers if w.id == targets[5]]
    assert len(built.value.value.workers) == 10 and len(left) == 1 and not left[0].held
    assert len(build_snapshot(core, 2.0).workers) == 9
