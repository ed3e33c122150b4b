"""A standalone `hsd dispatcher` answers bad input with typed errors and keeps serving."""

from __future__ import annotations

import os
import signal

import msgpack
import msgspec
import pytest

from common.wire import messages
from common.wire.client import DispatcherClient, run_id_for
from common.wire.messages import PROTOCOL_VERSION, ErrorCode, ProtocolError
from common.dataplane.shm_arena import list_segments
from hsd_testing import hsd, kill_tree, sim_args, start_hsd, stats, wait_for


@pytest.fixture
def dispatcher(run_dir, tmp_path):
    """A running dispatcher with a 4 KiB message limit; stopped (SIGTERM) and checked after the test."""
    proc = start_hsd("dispatcher", *sim_args(run_dir, "dispatcher.max_message_bytes=4096",
                                             "dispatcher.secret=s3cret"), log_path=tmp_path / "dispatcher.log")
    try:
        wait_for(lambda: (run_dir / "dispatcher.json").exists() or proc.poll() is not None, 60, what="dispatcher up")
        assert proc.poll() is None, (tmp_path / "dispatcher.log").read_text()
        yield proc
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not list_segments(run_id_for(run_dir)), "the dispatcher must unlink its arena on exit"
    finally:
        kill_tree(proc)


def endpoint(run_dir) -> str:
    return f"ipc://{run_dir / 'control.sock'}"


def raw(client: DispatcherClient, frames) -> messages.ErrorReply:
    """The dispatcher's answer to raw frames, which must be an error reply."""
    return msgspec.convert(client.call_raw(frames, timeout_s=5), messages.ErrorReply)


def test_bad_messages_get_typed_errors_and_the_dispatcher_keeps_serving(dispatcher, run_dir):
    client = DispatcherClient(endpoint(run_dir), timeout_s=5)
    try:
        def error_of(frames):
            reply = raw(client, frames)
            assert reply.ok is False
            return reply.error.code, reply.id

        base = {"secret": "s3cret"}
        assert error_of(b"\xc1 this is not msgpack")[0] == ErrorCode.MALFORMED
        assert error_of(msgpack.packb([1, 2, 3]))[0] == ErrorCode.MALFORMED
        assert error_of([msgpack.packb({"v": 1}), b"second frame"])[0] == ErrorCode.MALFORMED
        assert error_of(msgpack.packb({**base, "v": 99, "op": "heartbeat", "id": 7, "worker_id": "t0"})) == \
            (ErrorCode.BAD_VERSION, 7)
        assert error_of(msgpack.packb({**base, "v": PROTOCOL_VERSION, "op": "launch_missiles", "id": 8})) == (ErrorCode.UNKNOWN_OP, 8)
        assert error_of(msgpack.packb({**base, "v": PROTOCOL_VERSION, "op": "get_job", "id": 9})) == (ErrorCode.MALFORMED, 9)
        assert error_of(msgpack.packb({**base, "v": PROTOCOL_VERSION, "op": "register", "id": 10, "role": "target", "name": "x",
                                       "pid": "not an int", "host": "h"}))[0] == ErrorCode.MALFORMED
        assert error_of(msgpack.packb({**base, "v": PROTOCOL_VERSION, "op": "heartbeat", "id": 11, "worker_id": "t0",
                                       "padding": "x" * 8000}))[0] == ErrorCode.TOO_LARGE
        assert error_of(msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "id": 12, "worker_id": "t0",
                                       "token": "x", "holding": []}))[0] == \
            ErrorCode.UNAUTHORIZED
        assert error_of(msgpack.packb({**base, "v": PROTOCOL_VERSION, "op": "heartbeat", "id": 13, "worker_id": "t9",
                                       "token": "x", "holding": []}))[0] == \
            ErrorCode.UNKNOWN_WORKER
    finally:
        client.close()

    # Still serving: a real worker registers, gets a job, and a stale report of it is refused.
    worker = DispatcherClient(endpoint(run_dir), secret="s3cret", timeout_s=5)
    try:
        reg = worker.call(messages.Register(role="target", name="probe", pid=os.getpid(), host="elsewhere"))
        me = {"worker_id": reg.worker_id, "token": reg.token}
        for token in (None, "", "0" * 32):  # a request under this id without its session token
            with pytest.raises(ProtocolError) as refused:
                worker.call(messages.GetJob(worker_id=reg.worker_id, token=token, wait_ms=0))
            assert refused.value.code == ErrorCode.UNAUTHORIZED
        job = worker.call(messages.GetJob(**me, wait_ms=2000)).job
        assert job is not None and job.generation >= 1
        with pytest.raises(ProtocolError) as stale:
            worker.call(messages.JobReady(**me, job_id=job.job_id, generation=job.generation + 1, busy_s=0.0))
        assert stale.value.code == ErrorCode.BAD_STATE
        worker.call(messages.JobFailed(**me, job_id=job.job_id, reason="probe"))
        again = worker.call(messages.GetJob(**me, wait_ms=2000)).job
        assert again.job_id == job.job_id, "a given-back job goes to the head of the queue"
        worker.call(messages.Deregister(**me))
    finally:
        worker.close()

    snapshot = stats(run_dir)
    for code in (ErrorCode.MALFORMED, ErrorCode.BAD_VERSION, ErrorCode.UNKNOWN_OP, ErrorCode.TOO_LARGE,
                 ErrorCode.UNAUTHORIZED, ErrorCode.UNKNOWN_WORKER, ErrorCode.BAD_STATE):
        assert snapshot["errors"].get(code, 0) >= 1, code
    assert snapshot["given_back"]
    # the loop's CPU, by what it went to: each op it answered (refused ones too), and its wake-ups
    spent = snapshot["loop_cpu_s"]
    assert {"refused", "register", "get_job", "job_ready", "job_failed", "heartbeat", "deregister", "poll"} <= set(spent)
    assert all(seconds >= 0 for seconds in spent.values()) and sum(spent.values()) > 0
    assert snapshot["loop_wakeups"] > 0  # (a request sent right after a reply may be read in the same wake-up)


def test_a_drafters_registration_says_how_many_jobs_an_epoch_has(dispatcher, run_dir):
    """A drafter's learning-rate schedule spans run.epochs epochs: its register reply carries the jobs
    of one, as the dispatcher's schedule counts them (a target's reply has no need of it)."""
    client = DispatcherClient(endpoint(run_dir), secret="s3cret", timeout_s=5)
    try:
        drafter = client.call(messages.Register(role="drafter", name="probe-d", pid=os.getpid(), host="elsewhere",
                                                model=messages.ModelClaim(id="probe-model", step=0)))
        target = client.call(messages.Register(role="target", name="probe-t", pid=os.getpid(), host="elsewhere"))
        epochs = stats(run_dir)["epochs"]
        assert drafter.jobs_per_epoch == epochs[0]["jobs"] > 0
        assert target.jobs_per_epoch is None
        for reply in (drafter, target):
            client.call(messages.Deregister(worker_id=reply.worker_id, token=reply.token))
    finally:
        client.close()


def test_a_get_hs_carries_the_consumed_reports_once_and_is_served_whatever_they_find(dispatcher, run_dir):
    """A drafter's get_hs carries the consumed report of the slot it copied out: applied before the
    poll, skipped when the poll is asked again (or the job has committed since), and one that is
    refused (not this drafter's job) is counted while the poll is answered all the same."""
    client = DispatcherClient(endpoint(run_dir), secret="s3cret", timeout_s=5)
    try:
        target = client.call(messages.Register(role="target", name="probe-t", pid=os.getpid(), host="elsewhere"))
        drafter = client.call(messages.Register(role="drafter", name="probe-d", pid=os.getpid(), host="elsewhere",
                                                model=messages.ModelClaim(id="probe-model", step=0)))
        t = {"worker_id": target.worker_id, "token": target.token}
        d = {"worker_id": drafter.worker_id, "token": drafter.token}
        for _ in range(8):  # past pool.min_ready (6): drafters are served
            job = client.call(messages.GetJob(**t, wait_ms=2000)).job
            client.call(messages.JobReady(**t, job_id=job.job_id, generation=job.generation, busy_s=0.0))
        first = client.call(messages.GetHS(**d, wait_ms=2000)).job
        assert first is not None

        def jobs_by_state():
            return stats(run_dir)["jobs_by_state"]
        before = stats(run_dir)["errors"].get(ErrorCode.BAD_STATE, 0)
        second = client.call(messages.GetHS(**d, wait_ms=2000, consumed=[first.job_id])).job
        assert second is not None and second.job_id != first.job_id
        assert jobs_by_state()["consumed"] == 1 and jobs_by_state()["training"] == 1
        client.call(messages.GetHS(**d, wait_ms=0, consumed=[first.job_id]))  # asked again: applied once only
        assert jobs_by_state()["consumed"] == 1
        client.call(messages.CommitStep(**d, model="probe-model", step=1, job_ids=[first.job_id], busy_s=0.0))
        client.call(messages.GetHS(**d, wait_ms=0, consumed=[first.job_id]))  # committed since: nothing to do
        assert stats(run_dir)["errors"].get(ErrorCode.BAD_STATE, 0) == before
        # Not this drafter's job (still the target's to extract, or never granted): refused, the poll answered.
        pending = client.call(messages.GetJob(**t, wait_ms=2000)).job
        reply = client.call(messages.GetHS(**d, wait_ms=0, consumed=[pending.job_id]))
        assert isinstance(reply, messages.GrantReply)
        assert stats(run_dir)["errors"].get(ErrorCode.BAD_STATE, 0) == before + 1
        assert jobs_by_state()["consumed"] == 0 and jobs_by_state()["committed"] == 1
        for reply in (drafter, target):
            client.call(messages.Deregister(worker_id=reply.worker_id, token=reply.token))
    finally:
        client.close()


def test_a_get_job_carries_the_ready_reports_once_and_is_served_whatever_they_find(dispatcher, run_dir):
    """A target's get_job carries the ready report of the slot it wrote: applied before the poll,
    skipped when the poll is asked again (or the job moved on since), and one that is refused (a
    stale generation) is counted while the poll is answered all the same."""
    client = DispatcherClient(endpoint(run_dir), secret="s3cret", timeout_s=5)
    try:
        target = client.call(messages.Register(role="target", name="probe-t", pid=os.getpid(), host="elsewhere"))
        t = {"worker_id": target.worker_id, "token": target.token}

        def jobs_by_state():
            return stats(run_dir)["jobs_by_state"]

        def ready(job):
            return messages.ReadyReport(job_id=job.job_id, generation=job.generation, busy_s=0.01)
        before = stats(run_dir)["errors"].get(ErrorCode.BAD_STATE, 0)
        first = client.call(messages.GetJob(**t, wait_ms=2000)).job
        second = client.call(messages.GetJob(**t, wait_ms=2000, ready=[ready(first)])).job
        assert second is not None and second.job_id != first.job_id
        assert jobs_by_state()["ready"] == 1 and jobs_by_state()["extracting"] == 1
        again = client.call(messages.GetJob(**t, wait_ms=0, ready=[ready(first)])).job  # asked again: applied once
        assert jobs_by_state()["ready"] == 1
        assert stats(run_dir)["errors"].get(ErrorCode.BAD_STATE, 0) == before
        stale = msgspec.structs.replace(ready(second), generation=second.generation + 1)
        reply = client.call(messages.GetJob(**t, wait_ms=0, ready=[stale]))  # refused, the poll answered
        assert isinstance(reply, messages.GrantReply)
        assert stats(run_dir)["errors"].get(ErrorCode.BAD_STATE, 0) == before + 1
        assert jobs_by_state()["ready"] == 1
        held = [job for job in (second, again, reply.job) if job is not None]
        client.call(messages.GetJob(**t, wait_ms=0, ready=[ready(job) for job in held]))
        assert jobs_by_state()["ready"] == 1 + len(held)
        worker = next(w for w in stats(run_dir)["workers"] if w["id"] == target.worker_id)
        assert worker["jobs"] == 1 + len(held)
        client.call(messages.Deregister(**t))
    finally:
        client.close()


def test_stats_socket_is_read_only(dispatcher, run_dir):
    client = DispatcherClient(f"ipc://{run_dir / 'stats.sock'}", secret="s3cret", timeout_s=5)
    try:
        with pytest.raises(ProtocolError) as denied:
            client.call(messages.Register(role="target", name="x", pid=1, host="h"))
        assert denied.value.code == ErrorCode.READ_ONLY
        assert client.call(messages.Stats()).stats.run_dir == str(run_dir)
    finally:
        client.close()


def test_public_tcp_endpoint_without_secret_is_refused(run_dir):
    proc = hsd("dispatcher", *sim_args(run_dir, "dispatcher.endpoint=tcp://0.0.0.0:0"), check=False, timeout=60)
    assert proc.returncode == 2
    assert "dispatcher.secret" in proc.stderr


def test_second_dispatcher_on_the_same_run_dir_is_refused(dispatcher, run_dir):
    proc = hsd("dispatcher", *sim_args(run_dir, "dispatcher.secret=s3cret"), check=False, timeout=60)
    assert proc.returncode == 2
    assert f"another dispatcher (pid {dispatcher.pid}) is serving" in proc.stderr
    assert stats(run_dir)["pid"] == dispatcher.pid  # the first one is untouched


def test_prometheus_metrics_endpoint(run_dir, tmp_path):
    import socket
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_hsd("dispatcher", *sim_args(run_dir, f"dispatcher.metrics_port={port}"),
                     log_path=tmp_path / "dispatcher.log")
    try:
        def scrape():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                return None
            return text if "hsd_jobs" in text else None
        text = wait_for(scrape, 60, what="a /metrics scrape with a snapshot")
        assert 'hsd_jobs{state="pending"}' in text and "# TYPE hsd_steps_total counter" in text
        assert 'hsd_epoch_jobs{epoch="0"}' in text and "hsd_pool_bytes" in text
        assert 'hsd_loop_cpu_seconds_total{what="poll"}' in text and "hsd_loop_wakeups_total" in text
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        kill_tree(proc)
