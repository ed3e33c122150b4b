"""common/worker/runtime.py's resend_until_answered: which errors send a request again, and for how long."""

import pytest

from common.wire import messages
from common.worker import runtime as worker_runtime
from common.wire.messages import ErrorCode, ProtocolError
from common.worker.runtime import NoReply, on_no_reply, resend_until_answered


class Dispatcher:
    """Answers request N with ``answers[N]`` (an exception is raised); counts what was sent."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.sent = 0

    def send(self) -> int:
        self.sent += 1
        return self.sent - 1

    def wait(self, request_id: int):
        answer = self.answers[request_id]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_sent_again_while_unanswered_then_the_reply(caplog):
    d = Dispatcher(NoReply("lost"), NoReply("lost"), messages.Ack(id=2))
    again = on_no_reply(worker_runtime.log, "%s: %s got no reply; sending it again", "w", "op")
    assert resend_until_answered(d.send, d.wait, again=again) == messages.Ack(id=2) and d.sent == 3
    assert [r.getMessage() for r in caplog.records].count("w: op got no reply; sending it again") == 2


def test_the_request_in_flight_is_waited_for_first():
    d = Dispatcher(messages.Done(id=0, done=True))
    assert resend_until_answered(d.send, d.wait, again=lambda exc: 0.0, request_id=0) == messages.Done(id=0, done=True)
    assert d.sent == 0


def test_a_final_error_is_raised_at_once():
    d = Dispatcher(ProtocolError(ErrorCode.BAD_STATE, "refused"), messages.Ack(id=1))
    with pytest.raises(ProtocolError, match="refused"):
        resend_until_answered(d.send, d.wait, again=on_no_reply(worker_runtime.log, "again"))
    assert d.sent == 1


def test_past_the_deadline_the_last_error_is_raised_and_pauses_are_kept(monkeypatch):
    now = [0.0]
    slept = []
    monkeypatch.setattr(worker_runtime.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(worker_runtime.time, "sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    d = Dispatcher(*[ProtocolError(ErrorCode.INTERNAL, "not durable")] * 10)
    with pytest.raises(ProtocolError, match="not durable"):
        resend_until_answered(d.send, d.wait, again=lambda exc: 1.0, deadline_s=2.5)
    assert slept == [1.0, 1.0, 1.0] and d.sent == 4  # the fourth failure came past the deadline


def test_unless_makes_no_reply_final():
    d = Dispatcher(NoReply("lost"), messages.Ack(id=1))
    with pytest.raises(NoReply):
        resend_until_answered(d.send, d.wait, again=on_no_reply(worker_runtime.log, "again", unless=lambda: True))


def test_a_wait_the_process_slept_through_is_sent_again_past_the_deadline(monkeypatch, caplog):
    """Stopped (SIGSTOP) or suspended inside its wait for 75 s, the worker wakes past the 60 s
    deadline with the reply lost: that try proves nothing, so the request goes again and its answer
    is taken, rather than the dispatcher being declared gone."""
    now = [0.0]
    monkeypatch.setattr(worker_runtime.time, "monotonic", lambda: now[0])

    class PausedInItsFirstWait(Dispatcher):
        def wait(self, request_id: int):
            now[0] += 75.0 if request_id == 0 else 0.01
            return super().wait(request_id)
    d = PausedInItsFirstWait(NoReply("lost"), messages.Ack(id=1))
    again = on_no_reply(worker_runtime.log, "again")
    assert resend_until_answered(d.send, d.wait, again=again, deadline_s=60.0, wait_s=10.0) == messages.Ack(id=1)
    assert d.sent == 2
    assert any("this process was paused" in r.getMessage() for r in caplog.records)


def test_a_dispatcher_silent_for_the_whole_waking_deadline_is_gone(monkeypatch):
    """Waits that last their bound are waking time: past the deadline the last NoReply is raised."""
    now = [0.0]
    monkeypatch.setattr(worker_runtime.time, "monotonic", lambda: now[0])

    class Silent(Dispatcher):
        def wait(self, request_id: int):
            now[0] += 10.0
            return super().wait(request_id)
    d = Silent(*[NoReply("lost")] * 10)
    with pytest.raises(NoReply):
        resend_until_answered(d.send, d.wait, again=on_no_reply(worker_runtime.log, "again"), deadline_s=25.0,
                              wait_s=10.0)
    assert d.sent == 3
