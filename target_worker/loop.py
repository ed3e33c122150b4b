"""A target worker: get_job, fill the slot through the backend, report it ready; the next get_job in flight.

A job's ready report rides on the get_job that follows it (protocol v4: one message a job), sent as
soon as the previous get_job is answered; when that one is still waiting (no slot or job free), the
report goes at once in a job_ready of its own, so a written slot is never held back by a wait.

With ``pool.target_credits`` of 2 (the default) the dispatcher grants the prefetched request while
the current job computes, so the next job (and its slot) is waiting when this one is reported.
A data error (the dataset does not hold a sample as scheduled) ends the worker at once, after the
job is reported failed: every later job would read the same data (``hsd target`` then exits with
the unusable code, which ``hsd launch`` does not restart).

A rank of a tensor-parallel target group that died or hung (:class:`TargetGroupLost`) fails the job
in flight (given back once, its slot never published) and ends the worker, whose whole group
``hsd launch`` restarts.

A backend may hand back its slot still being written (:class:`common.worker.backends.PendingSlotWrite`,
a GPU target's copy on a side stream): the loop then starts the next job's forward first and
reports the previous job ready only once its copy has landed and its header is published.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from common import faults
from common.run.descriptors import TransportInfo
from common.run.prepared import DataError
from common.wire import messages
from common.dataplane.transport import TargetTransport, open_target_transport
from common.worker.backends import PendingSlotWrite, TargetBackend
from common.worker.loop import WorkerLoop
from common.worker.runtime import DispatcherAddress
from target_worker.tp_group import TargetGroup, TargetGroupLost

log = logging.getLogger("hsd.target")

MAX_CONSECUTIVE_FAILURES = 3  # a backend that fails this many jobs in a row is broken, not unlucky


class TargetLoop(WorkerLoop):
    role = "target"

    def __init__(self, address: DispatcherAddress, name: str, backend: TargetBackend, *,
                 group: TargetGroup | None = None, **kwargs: Any):
        """``group``: the tensor-parallel group this worker is rank 0 of (its ranks show in stats)."""
        super().__init__(address, name, backend, **kwargs)
        self.group = group
        self.num_jobs = 0
        self.num_failed = 0
        self._to_carry: list[messages.ReadyReport] = []  # finished: reported by the next get_job
        self._carried: list[messages.ReadyReport] = []  # reported by the get_job in flight
        self._poll_in_flight: int | None = None

    def _register(self) -> messages.RegisterReply:
        ranks = self.group.ranks() if self.group is not None else None
        return self.session.register(contract=self.backend.contract, tp_ranks=ranks)

    def _open_transport(self, info: TransportInfo) -> TargetTransport:
        return open_target_transport(info, device=self._device(info))

    def _poll_request(self) -> messages.GetJob:
        # sent again unchanged while unanswered: a report it carries is applied once
        return messages.GetJob(wait_ms=self.poll_ms, ready=self._carried)

    def _poll(self) -> int:
        if self._to_carry:  # the reports of the jobs finished since the last poll go with this one
            self._carried, self._to_carry = self._carried + self._to_carry, []
        self._poll_in_flight = super()._poll()
        return self._poll_in_flight

    def _lost(self) -> None:
        self._carried, self._to_carry = [], []  # the jobs went back with the registration

    def _work(self, registration: messages.RegisterReply, transport: TargetTransport) -> None:
        session = self.session
        ipc_block = transport.export()
        if ipc_block is not None:  # cuda_ipc: our own GPU slots join the pool
            session.call(messages.RegisterSlots(ipc_block=ipc_block, num_slots=transport.num_slots))
        self._reports: list[int] = []
        self._failures_in_a_row = 0
        # A job whose slot is still being copied (a GPU target's side stream): reported once the copy lands,
        # after the next job's forward is queued, so the two overlap.
        pending: PendingJob | None = None
        poll = self._poll()
        while True:
            if pending is not None and not session.done(poll):
                # Nothing to overlap with yet: report what we hold rather than sit on it while we wait.
                self._complete(pending, transport)
                pending = None
            reply = self._await_poll(poll)
            self._carried = []  # applied, whatever the reply
            if reply.done or self.stopping:
                if pending is not None:
                    self._complete(pending, transport)
                self._send_carried_alone()
                self._collect(self._reports, wait=True)
                if reply.done:
                    log.info("%s: run complete after %d jobs", self.name, self.num_jobs)
                return
            poll = self._poll()  # prefetch: the next grant arrives while this job computes
            self._reports = self._collect(self._reports)
            job = reply.job
            if job is None:
                continue
            faults.stop_in_job(self.name, job.job_id)  # a test acts on a target that holds a job
            started = time.perf_counter()
            failure: Exception | None = None
            try:
                written = self.backend.extract(job, transport.slot(job.slot))
            except Exception as exc:
                written, failure = None, exc
            if pending is not None:  # its copy drained while this job's forward was queued
                self._complete(pending, transport)
                pending = None
            if failure is not None:
                self._failed(job, failure)
                continue
            pending = PendingJob(job, written, time.perf_counter() - started)
            if written is None:  # the slot is complete: report it now
                self._complete(pending, transport)
                pending = None

    def _complete(self, pending: "PendingJob", transport: TargetTransport) -> None:
        """Wait for the job's slot to be complete, publish it, report it ready (or failed)."""
        job = pending.job
        started = time.perf_counter()
        try:
            if pending.written is not None:
                pending.written.wait()
            transport.finish_write(job.slot, stream=pending.written.stream if pending.written is not None else None)
        except Exception as exc:
            self._failed(job, exc)
            return
        self._failures_in_a_row = 0
        if pending.written is not None:  # the wait for the slot's copy to land, and publishing it
            self.copy_times.add(time.perf_counter() - started)
        else:  # the backend filled the slot inside extract: the copy is what came between its marks
            write_s = transport.slot(job.slot).write_s
            if write_s is not None:
                self.copy_times.add(write_s)
        report = messages.ReadyReport(job_id=job.job_id, generation=job.generation,
                                      busy_s=pending.busy_s + time.perf_counter() - started)
        self._to_carry.append(report)
        if self._poll_in_flight is None or not self.session.done(self._poll_in_flight):  # it may wait: a report cannot
            self._send_carried_alone()
        self.num_jobs += 1

    def _send_carried_alone(self) -> None:
        for report in self._to_carry:
            self._reports.append(self.session.submit(messages.JobReady(
                job_id=report.job_id, generation=report.generation, busy_s=report.busy_s)))
        self._to_carry = []

    def _failed(self, job: messages.Job, exc: Exception) -> None:
        self._failures_in_a_row += 1
        self.num_failed += 1
        if isinstance(exc, (DataError, TargetGroupLost)):  # the message says what happened: no traceback to read
            log.error("%s: job %d failed: %s", self.name, job.job_id, exc)
        else:
            log.exception("%s: job %d failed", self.name, job.job_id, exc_info=exc)
        self._reports.append(self.session.submit(messages.JobFailed(job_id=job.job_id,
                                                                    reason=f"{type(exc).__name__}: {exc}"[:500])))
        # A data error recurs on every job; a lost group rank ends this incarnation of the group.
        if isinstance(exc, (DataError, TargetGroupLost)) or self._failures_in_a_row >= MAX_CONSECUTIVE_FAILURES:
            self._send_carried_alone()  # no get_job follows
            self._collect(self._reports, wait=True)
            raise exc


@dataclass
class PendingJob:
    job: messages.Job
    written: PendingSlotWrite | None  # None: the backend completed the slot inside extract
    busy_s: float  # seconds spent in extract
