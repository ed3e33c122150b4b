"""A target worker: get_job, fill the slot through the backend, job_ready; the next get_job in flight.

With ``pool.target_credits`` of 2 (the default) the dispatcher grants the prefetched request while
the current job computes, so the next job (and its slot) is waiting when this one is reported.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.config import Config
from common.transport import TargetTransport, open_target_transport
from common.worker_backends import TargetBackend
from common.worker_loop import WorkerLoop

log = logging.getLogger("hsd.target")

MAX_CONSECUTIVE_FAILURES = 3  # a backend that fails this many jobs in a row is broken, not unlucky


class TargetLoop(WorkerLoop):
    role = "target"

    def __init__(self, config: Config, name: str, backend: TargetBackend, **kwargs: Any):
        super().__init__(config, name, backend, **kwargs)
        self.num_jobs = 0
        self.num_failed = 0

    def _open_transport(self, info: dict[str, Any]) -> TargetTransport:
        return open_target_transport(info, device=self._device(info))

    def _work(self, registration: dict[str, Any], transport: TargetTransport) -> None:
        session = self.session
        ipc_block = transport.export()
        if ipc_block is not None:  # cuda_ipc: our own GPU slots join the pool
            session.call("register_slots", ipc_block=ipc_block, num_slots=transport.num_slots)
        reports: list[int] = []
        failures_in_a_row = 0
        poll = self._poll("get_job")
        while True:
            reply = self._await_poll(poll, "get_job")
            if reply["done"] or self.stopping:
                self._collect(reports, wait=True)
                if reply["done"]:
                    log.info("%s: run complete after %d jobs", self.name, self.num_jobs)
                return
            poll = self._poll("get_job")  # prefetch: the next grant arrives while this job computes
            reports = self._collect(reports)
            job = reply["job"]
            if job is None:
                continue
            started = time.perf_counter()
            try:
                self.backend.extract(job, transport.slot(job["slot"]))
                transport.finish_write(job["slot"])
            except Exception as exc:
                failures_in_a_row += 1
                self.num_failed += 1
                log.exception("%s: job %d failed", self.name, job["job_id"])
                reports.append(session.submit("job_failed", job_id=job["job_id"],
                                              reason=f"{type(exc).__name__}: {exc}"[:500]))
                if failures_in_a_row >= MAX_CONSECUTIVE_FAILURES:
                    self._collect(reports, wait=True)
                    raise
                continue
            failures_in_a_row = 0
            reports.append(session.submit("job_ready", job_id=job["job_id"], generation=job["generation"],
                                          busy_s=time.perf_counter() - started))
            self.num_jobs += 1
