"""A worker's session against a scripted dispatcher: what a reply of "unknown worker" does to the
session's other waits (real sockets; :mod:`loop_harness`)."""

from __future__ import annotations

import pytest

from common.wire import messages
from common.wire.client import run_id_for
from common.worker.gpu_health import ReportingSession
from common.worker.runtime import DispatcherAddress, WorkerLost
from loop_harness import FakeDispatcher


@pytest.fixture
def fake(tmp_path):
    dispatcher = FakeDispatcher(f"ipc://{tmp_path / 'control.sock'}", run_id_for(tmp_path / "run"))
    yield dispatcher
    dispatcher.close()


def test_a_request_refused_as_unknown_ends_every_wait_of_the_session_until_it_registers_again(tmp_path, fake):
    """A commit answered "unknown worker" (this worker was declared dead while paused): the poll
    still parked ends at once, as after a refused heartbeat, and so does any wait that watches for
    that refusal (a rank's collective), rather than at its own bound; registering again clears it."""
    session = ReportingSession(DispatcherAddress(endpoint=fake.endpoint), "drafter", "drafter-0")
    try:
        session.register()
        parked = session.submit(messages.GetHS(wait_ms=30_000))  # nothing ready: the fake parks it
        fake.commit_faults.append("forget")
        with pytest.raises(WorkerLost):
            session.call(messages.CommitStep(model="drafter-0", step=1, job_ids=[], busy_s=0.0))
        assert session.channel.heartbeat_refused.is_set()  # what a collective's watch reads
        with pytest.raises(WorkerLost):  # not its empty answer, 30 s on
            session.result(parked, timeout_s=60)
        session.register()
        assert not session.channel.heartbeat_refused.is_set()
        assert isinstance(session.call(messages.Consumed(job_id=1)), messages.Ack)
    finally:
        session.close(deregister=False)
