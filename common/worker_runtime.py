"""What every worker process does around its own work: register, heartbeat, re-register, leave.

A worker talks to the dispatcher through a :class:`WorkerSession`. A background thread sends
heartbeats with a client of its own (sockets are not thread-safe) so leases stay alive while the
main thread computes. When the dispatcher restarts it no longer knows the worker: calls then raise
:class:`WorkerLost` and the worker registers again and carries on with fresh jobs.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, TypeVar

from common.client import DispatcherClient, DispatcherUnavailable
from common.config import Config
from common.protocol import ErrorCode, ProtocolError

log = logging.getLogger("hsd.worker")

RECONNECT_S = 60.0  # how long a worker keeps trying to reach a dispatcher that went away
CALL_TIMEOUT_S = 10.0


class WorkerLost(Exception):
    """The dispatcher no longer knows this worker (it restarted, or declared the worker dead)."""


class DispatcherGone(Exception):
    """The dispatcher stayed unreachable for RECONNECT_S."""


class WorkerSession:
    def __init__(self, config: Config, role: str, name: str, *, gpu: int | None = None):
        self.config = config
        self.role = role
        self.name = name
        self.gpu = gpu
        self.endpoint = config.control_endpoint
        self.client = DispatcherClient(self.endpoint, secret=config.dispatcher.secret, timeout_s=CALL_TIMEOUT_S)
        self.worker_id: str | None = None
        self.token: str = ""
        self.registration: dict[str, Any] = {}
        self.holding: set[int] = set()  # job ids this worker holds; each heartbeat lists them
        self.seen_grant = 0  # number of the latest job grant received
        self.stop_requested = threading.Event()
        self.register_extra: Callable[[], dict[str, Any]] = dict  # extra register fields (a drafter's model)
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()

    def install_signal_handlers(self) -> None:
        def on_signal(signum, _frame):
            log.info("%s: signal %d, leaving after the current job", self.name, signum)
            self.stop_requested.set()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def register(self, **extra: Any) -> dict[str, Any]:
        """Register (retrying while the dispatcher starts) and start heartbeats."""
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                reply = self.client.call("register", role=self.role, name=self.name, pid=os.getpid(),
                                         host=socket.gethostname(), gpu=self.gpu, **self.register_extra(), **extra)
                break
            except DispatcherUnavailable:
                if time.monotonic() > deadline or self.stop_requested.is_set():
                    raise DispatcherGone(f"no dispatcher at {self.endpoint} for {RECONNECT_S:.0f}s") from None
        self.worker_id = reply["worker_id"]
        self.token = reply["token"]
        self.holding = set()
        self.seen_grant = 0
        self.registration = reply
        self._start_heartbeats(reply["heartbeat_s"])
        log.info("%s registered as %s with run %s", self.name, self.worker_id, reply["run_id"])
        return reply

    def call(self, op: str, *, timeout_s: float = CALL_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """A call on behalf of this worker; retries while the dispatcher is briefly unreachable."""
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                return self.client.call(op, worker_id=self.worker_id, token=self.token, timeout_s=timeout_s, **fields)
            except ProtocolError as exc:
                raise self._lost_if_unknown(exc) from None
            except DispatcherUnavailable:
                if time.monotonic() > deadline:
                    raise DispatcherGone(f"no dispatcher at {self.endpoint} for {RECONNECT_S:.0f}s") from None
                # The request may have been served; a repeat of a state-changing op gets BAD_STATE,
                # and the caller's job is then given back by the dispatcher on its own.
                if op not in ("get_job", "get_hs", "heartbeat"):
                    raise WorkerLost(f"{op} got no reply") from None

    def _lost_if_unknown(self, exc: ProtocolError) -> Exception:
        """The exception to raise for an error reply: WorkerLost when the dispatcher forgot us."""
        if exc.code != ErrorCode.UNKNOWN_WORKER:
            return exc
        self._stop_heartbeats()
        return WorkerLost(exc.message)

    def submit(self, op: str, **fields: Any) -> int:
        """Send on this worker's behalf without waiting (pipelining); see :meth:`result`."""
        return self.client.submit(op, worker_id=self.worker_id, token=self.token, **fields)

    def result(self, request_id: int, *, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """The reply to :meth:`submit`. A pipelined worker that loses a reply cannot tell what the
        dispatcher did with it, so it starts over: WorkerLost, and the dispatcher gives its jobs back."""
        try:
            return self.client.result(request_id, timeout_s=timeout_s)
        except ProtocolError as exc:
            raise self._lost_if_unknown(exc) from None
        except DispatcherUnavailable:
            raise WorkerLost(f"request {request_id} got no reply") from None

    def report(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """A state-changing call that the dispatcher may refuse because the job was already given back
        (its lease ran out, or the step lost a job): None then, and the caller drops that work."""
        try:
            return self.call(op, **fields)
        except ProtocolError as exc:
            if exc.code != ErrorCode.BAD_STATE:
                raise
            log.warning("%s: %s refused, dropping that work: %s", self.name, op, exc.message)
            return None

    def poll(self, op: str, wait_ms: int = 1000) -> dict[str, Any]:
        return self.call(op, wait_ms=wait_ms, timeout_s=wait_ms / 1000 + CALL_TIMEOUT_S)

    def _start_heartbeats(self, interval_s: float) -> None:
        self._stop_heartbeats()
        self._heartbeat_stop = threading.Event()
        worker_id, token, stop = self.worker_id, self.token, self._heartbeat_stop

        def beat() -> None:
            client = DispatcherClient(self.endpoint, secret=self.config.dispatcher.secret, timeout_s=CALL_TIMEOUT_S)
            try:
                while not stop.wait(interval_s):
                    try:
                        client.call("heartbeat", worker_id=worker_id, token=token, holding=list(self.holding.copy()),
                                    seen_grant=self.seen_grant)
                    except DispatcherUnavailable:
                        continue
                    except ProtocolError as exc:
                        if exc.code == ErrorCode.UNKNOWN_WORKER:
                            return
            finally:
                client.close()

        self._heartbeat_thread = threading.Thread(target=beat, name=f"{self.name}-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def _stop_heartbeats(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None and self._heartbeat_thread is not threading.current_thread():
            self._heartbeat_thread.join(timeout=5)
        self._heartbeat_thread = None

    def close(self, *, deregister: bool = True) -> None:
        self._stop_heartbeats()
        if deregister and self.worker_id is not None:
            try:
                self.client.call("deregister", worker_id=self.worker_id, token=self.token, timeout_s=2.0)
            except (ProtocolError, DispatcherUnavailable):
                pass
        self.worker_id = None
        self.client.close()


Transport = TypeVar("Transport")


def run_worker(session: WorkerSession, open_transport: Callable[[dict[str, Any]], Transport],
               work: Callable[[dict[str, Any], Transport], None]) -> int:
    """Register, open the data plane, and ``work`` until the run is done or a signal asks to stop.

    ``work`` returns when the dispatcher says the run is done (or a stop was requested); if the
    dispatcher forgets the worker (it restarted), the worker registers again, with a fresh
    transport (a new dispatcher means a new arena), and goes on.
    """
    session.install_signal_handlers()
    try:
        while not session.stop_requested.is_set():
            registration = session.register()
            transport = open_transport(registration["transport"])
            try:
                work(registration, transport)
                return 0
            except WorkerLost as exc:
                log.warning("%s: the dispatcher lost track of us (%s); registering again", session.name, exc)
            finally:
                transport.close()
        return 0
    finally:
        session.close()


def sim_device(transport_info: dict[str, Any]) -> str:
    """Sim workers compute nothing, but cuda_ipc slots live on a GPU."""
    return "cuda" if transport_info.get("kind") == "cuda_ipc" else "cpu"
