"""The one loop every worker runs: register, open the data plane, work, and start over when lost.

A worker is a :class:`TargetLoop` (:mod:`target_worker.loop`) or a :class:`DrafterLoop`
(:mod:`drafter_worker.loop`) around a backend (:mod:`common.worker.backends`) that only computes.
The loop here owns what they share:

- registration, retried while the dispatcher starts; the session token; heartbeats that list the
  jobs the worker holds (:mod:`common.worker.runtime`) and, on a GPU, its health
  (:mod:`common.worker.gpu_health`);
- the transport: opened from the register reply, closed (and opened afresh) when the dispatcher
  restarts, since a new dispatcher means a new arena;
- prefetch: the next ``get_job``/``get_hs`` is always in flight while the current job computes, so
  when work is available the hot loop never waits on the control plane;
- a poll that got no reply is asked again (a grant lost with it is given back by the dispatcher,
  since no heartbeat lists it); an unknown worker (the dispatcher restarted) registers again;
- a clean stop on SIGTERM/SIGINT after the current job, leaving through ``deregister``.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import msgspec

from common.run.config import Config
from common.run.descriptors import CudaIpcInfo, TransportInfo
from common.wire import messages
from common.wire.messages import ErrorCode, ProtocolError
from common.worker.gpu_health import CopyTimes, GpuHealthProbe, ReportingSession
from common.worker.runtime import (CALL_TIMEOUT_S, DispatcherAddress, DispatcherGone, NoReply, WorkerLost,
                                   on_no_reply, resend_until_answered)

log = logging.getLogger("hsd.worker")

POLL_MS = 1000  # long-poll of get_job/get_hs; also bounds how long a stop request waits
# Asked to stop, a worker waits this long at most for any one reply, the one in flight included: a
# dispatcher that answers does so well within it, and one that does not keeps the worker no longer
# than a few such waits (its poll, its last commit, its checkpoint's report, its deregister), well
# within the launcher's stop grace.
STOP_WAIT_S = 2.0
EMPTY_POLL = messages.GrantReply(job=None, done=False)  # what a poll given up on (asked to stop) amounts to


def sim_device(transport_info: TransportInfo) -> str:
    """Sim workers compute nothing, but cuda_ipc slots live on a GPU."""
    return "cuda" if isinstance(transport_info, CudaIpcInfo) else "cpu"


class WorkerLoop:
    role = ""

    def __init__(self, address: DispatcherAddress, name: str, backend: Any, *, gpu: int | None = None,
                 external_stop: Any = None):
        """``address``: the dispatcher's (:meth:`DispatcherAddress.from_config`); ``external_stop``:
        anything with ``is_set()`` (a multiprocessing Event) that also stops the loop."""
        self.name = name
        self.backend = backend
        self.session = ReportingSession(address, self.role, name, gpu=gpu)
        self.copy_times = CopyTimes()  # each slot's copy (target: into the slot; drafter: out of it), for stats
        self.session.copies = self.copy_times
        self._external_stop = external_stop
        self.poll_ms = POLL_MS

    @classmethod
    def from_config(cls, config: Config, name: str, backend: Any, **kwargs: Any) -> WorkerLoop:
        """The loop of a run's config: the sections it reads handed over."""
        return cls(DispatcherAddress.from_config(config), name, backend, **kwargs)

    # -- stopping -----------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self.session.stop_requested.is_set() or bool(self._external_stop and self._external_stop.is_set())

    def request_stop(self) -> None:
        """Stop after the current job; the wait for a reply under way ends within STOP_WAIT_S (also
        called from the SIGTERM handler, on the thread that may be in that wait)."""
        self.session.stop_requested.set()
        self.session.channel.limit_waits(STOP_WAIT_S)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, _frame):
            log.info("%s: signal %d, leaving after the current job", self.name, signum)
            self.request_stop()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        """Work until the dispatcher says the run is done (0), or a stop is requested (0)."""
        self._install_signal_handlers()
        try:
            self._start()
            while not self.stopping:
                try:
                    registration = self._register()
                except DispatcherGone:
                    if self.stopping:  # asked to stop while looking for a dispatcher: nothing to leave
                        return 0
                    raise
                self._registered(registration)
                transport = self._open_transport(registration.transport)
                self.session.health = GpuHealthProbe(self._device(registration.transport)).read
                try:
                    self._work(registration, transport)
                    return 0
                except WorkerLost as exc:
                    log.warning("%s: %s (%s); registering again", self.name, exc.what, exc)
                    self._lost()
                finally:
                    transport.close()
            return 0
        finally:
            self.session.close()

    def _start(self) -> None:
        """Once, before the first registration."""

    def _register(self) -> messages.RegisterReply:
        return self.session.register(contract=self.backend.contract)

    def _registered(self, registration: messages.RegisterReply) -> None:
        """After each registration, before the transport opens: what the reply tells the backend."""

    def _open_transport(self, info: TransportInfo) -> Any:
        raise NotImplementedError

    def _device(self, info: TransportInfo) -> Any:
        return self.backend.device or sim_device(info)

    def _work(self, registration: messages.RegisterReply, transport: Any) -> None:
        raise NotImplementedError

    def _lost(self) -> None:
        """The dispatcher forgot us: drop what only it could have accepted."""

    # -- helpers ------------------------------------------------------------------------------
    def _poll_request(self) -> messages.WorkerRequest:
        """The long-poll for this worker's next job (get_job, get_hs)."""
        raise NotImplementedError

    def _poll(self) -> int:
        return self.session.submit(self._poll_request())

    def _await_poll(self, request_id: int) -> messages.GrantReply:
        """The reply to a long-poll; asked again while the dispatcher does not answer (a stop ends the wait)."""
        op = messages.op_of(self._poll_request())
        try:
            return resend_until_answered(self._poll,
                                         lambda request_id: self.session.result(
                                             request_id, timeout_s=self.poll_ms / 1000 + CALL_TIMEOUT_S),
                                         request_id=request_id,
                                         again=on_no_reply(log, "%s: %s got no reply; asking again", self.name, op,
                                                           unless=lambda: self.stopping),
                                         deadline_s=self.session.reconnect_s,
                                         wait_s=self.poll_ms / 1000 + CALL_TIMEOUT_S)
        except NoReply:
            if self.stopping:
                return msgspec.structs.replace(EMPTY_POLL)
            raise self.session.gone() from None

    def _collect(self, request_ids: list[int], *, wait: bool = False) -> list[int]:
        """Settle pipelined reports whose replies are in (all of them with ``wait``); return the rest.

        A refusal (the job was given back meanwhile) only drops that work: the dispatcher has it again.
        """
        left = []
        for request_id in request_ids:
            if not wait and not self.session.done(request_id):
                left.append(request_id)
                continue
            try:
                self.session.result(request_id)
            except ProtocolError as exc:
                if exc.code != ErrorCode.BAD_STATE:
                    raise
                log.warning("%s: a report was refused, that work is dropped: %s", self.name, exc.message)
        return left
