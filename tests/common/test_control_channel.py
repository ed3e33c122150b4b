"""common/wire/control_channel.py: requests go out from submit in order, a full socket queue included;
replies are seen by the I/O thread; a reset drops what was queued."""

import contextlib
import threading
import time

import pytest
import zmq

from common.wire import messages
from common.wire.client import DispatcherUnavailable
from common.wire.control_channel import ControlChannel
from common.wire.heartbeats import LIST_HELD_EVERY


def _serve(router: zmq.Socket, stop: threading.Event, seen: list[int]) -> None:
    """Answer every heartbeat (ok, echoing its id), noting the ids in arrival order."""
    while not stop.is_set():
        if not router.poll(50):
            continue
        identity, frame = router.recv_multipart()
        request = messages.decode_request(frame)
        seen.append(request.id)
        router.send_multipart([identity, messages.encode(messages.Done(id=request.id, done=False))])


@contextlib.contextmanager
def _answering(endpoint: str):
    """A ROUTER bound at ``endpoint`` answering every heartbeat on a thread; yields the ids it saw."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    stop, seen = threading.Event(), []
    server = threading.Thread(target=_serve, args=(router, stop, seen), daemon=True)
    server.start()
    try:
        yield seen
    finally:
        stop.set()
        server.join(5)
        router.close(linger=0)


def test_requests_go_out_in_order_when_the_socket_queue_fills_before_a_dispatcher_listens(tmp_path):
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    replies: list[int] = []
    channel = ControlChannel(endpoint, on_reply=lambda request, reply: replies.append(reply.id))
    try:
        # Nobody listens yet: past the socket's high-water mark (1000) requests wait in the outbox.
        ids = [channel.submit(messages.Heartbeat(holding=[])) for _ in range(1500)]
        with _answering(endpoint) as seen:
            assert channel.result(ids[-1], timeout_s=30) == messages.Done(id=ids[-1], done=False)
            assert all(channel.result(i, timeout_s=5).id == i for i in ids[:-1])
            assert seen == ids  # sent in order, the queued ones after those the socket took
            assert sorted(replies) == ids  # every reply went through on_reply on the I/O thread
            later = channel.submit(messages.Heartbeat(holding=[]))  # the outbox drained: straight from submit again
            assert channel.result(later, timeout_s=5).id == later and seen[-1] == later
    finally:
        channel.close()


def test_a_reply_seen_by_the_hook_reaches_the_caller_who_asks_while_the_hook_runs(tmp_path):
    # The order a fast machine makes: the I/O thread has taken the reply (the hook counts the granted
    # job as held) when the main thread asks for it. The caller must get that reply, never "given up":
    # a job the hook holds but no caller got would be listed in every heartbeat and never given back.
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    in_hook, release = threading.Event(), threading.Event()

    def hook(request, reply):
        in_hook.set()
        release.wait(2)  # whatever the caller does meanwhile, the hook finishes (the channel must not hang)

    with _answering(endpoint):
        channel = ControlChannel(endpoint, on_reply=hook)
        try:
            request_id = channel.submit(messages.Heartbeat(holding=[]))
            assert in_hook.wait(10)
            outcome: list = []
            caller = threading.Thread(target=lambda: outcome.append(_result_or_error(channel, request_id)))
            caller.start()
            caller.join(0.5)  # the caller asks while the hook still runs ...
            release.set()  # ... and the hook then finishes
            caller.join(10)
            assert outcome == [messages.Done(id=request_id, done=False)]
        finally:
            release.set()
            channel.close()


def _result_or_error(channel: ControlChannel, request_id: int):
    try:
        return channel.result(request_id, timeout_s=10)
    except Exception as exc:  # what the caller would see instead of the reply
        return exc


def test_a_stop_ends_the_wait_in_flight_when_no_dispatcher_answers(tmp_path):
    """Asked to stop (limit_waits), a worker waiting for a reply that will not come is woken within
    the limit, not at its own 30 s timeout, and a later wait lasts no longer either."""
    channel = ControlChannel(f"ipc://{tmp_path / 'nobody.sock'}")
    try:
        request_id = channel.submit(messages.Heartbeat(holding=[]))
        timer = threading.Timer(0.2, channel.limit_waits, args=(0.3,))
        started = time.monotonic()
        timer.start()
        with pytest.raises(DispatcherUnavailable):
            channel.result(request_id, timeout_s=30)
        assert time.monotonic() - started < 5
        started = time.monotonic()
        with pytest.raises(DispatcherUnavailable):
            channel.call(messages.Heartbeat(holding=[]), timeout_s=30)
        assert time.monotonic() - started < 5
    finally:
        channel.close()


def test_a_busy_worker_skips_its_heartbeats_and_a_silent_one_beats(tmp_path):
    """A beat goes out only when no request went out within the interval (the dispatcher counts any
    request as a sign of life); a busy worker still beats once in LIST_HELD_EVERY, listing its jobs."""
    interval_s = 0.2
    with _answering(f"ipc://{tmp_path / 'd.sock'}") as seen:
        channel = ControlChannel(f"ipc://{tmp_path / 'd.sock'}")
        try:
            channel.set_heartbeat(interval_s, lambda: messages.Heartbeat(holding=[]))
            requests: set[int] = set()
            busy_until = time.monotonic() + LIST_HELD_EVERY * interval_s
            while time.monotonic() < busy_until:  # a request every tenth of the interval
                requests.add(channel.submit(messages.Heartbeat(holding=[])))
                time.sleep(interval_s / 10)
            for request_id in requests:
                channel.result(request_id, timeout_s=10)
            beats_while_busy = [i for i in list(seen) if i not in requests]
            assert len(beats_while_busy) <= 3  # one expected (LIST_HELD_EVERY beats were due); all of them before
            silent_since = len(seen)
            deadline = time.monotonic() + 10
            while len(seen) < silent_since + 2 and time.monotonic() < deadline:  # silent: it beats again
                time.sleep(interval_s / 4)
            assert len(seen) >= silent_since + 2
        finally:
            channel.close()
