"""A simulated target: the full protocol and data plane, with a modeled forward-pass cost.

It sleeps ``target.sim_cost_per_token`` seconds per token of the job, then fills its slot with a
pattern derived from the job id, which the sim drafter verifies: an end-to-end check of the
control plane and the hidden-state bytes before any real model is involved.
"""

from __future__ import annotations

import logging
import time

from common.config import Config
from common.slot_pattern import fill_pattern
from common.transport import TargetTransport, open_target_transport
from common.worker_runtime import WorkerSession, run_worker, sim_device

log = logging.getLogger("hsd.target")


def run_sim_target(config: Config, name: str) -> int:
    session = WorkerSession(config, "target", name)
    cost = config.target.sim_cost_per_token
    num_jobs = 0

    def work(registration: dict, transport: TargetTransport) -> None:
        nonlocal num_jobs
        ipc_block = transport.export()
        if ipc_block is not None:  # cuda_ipc: our own GPU slots join the pool
            session.call("register_slots", ipc_block=ipc_block, num_slots=transport.num_slots)
        while not session.stop_requested.is_set():
            reply = session.poll("get_job")
            if reply["done"]:
                log.info("%s: run complete after %d jobs", name, num_jobs)
                return
            job = reply["job"]
            if job is None:
                continue
            session.holding.add(job["job_id"])
            session.seen_grant = max(session.seen_grant, job["grant"])
            started = time.perf_counter()
            time.sleep(cost * job["num_tokens"])
            fill_pattern(transport.slot(job["slot"]), job_id=job["job_id"], generation=job["generation"],
                         bucket=job["bucket"], batch_size=len(job["samples"]), seq_len=job["seq_len"],
                         seq_lens=job["lengths"])
            transport.finish_write(job["slot"])
            if session.report("job_ready", job_id=job["job_id"], generation=job["generation"],
                              busy_s=time.perf_counter() - started) is not None:
                num_jobs += 1
            session.holding.discard(job["job_id"])

    return run_worker(session, lambda info: open_target_transport(info, device=sim_device(info)), work)
