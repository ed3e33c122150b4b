"""A simulated drafter: pulls ready hidden states, verifies their bytes, models the training cost.

It groups ``drafter.accum_steps`` micro-batches into one optimizer step and commits it; when the
dispatcher says nothing more is coming (``flush``) it commits a partial step. Any byte that
differs from the pattern the sim target wrote fails the worker loudly.
"""

from __future__ import annotations

import logging
import time

from common.config import Config
from common.slot_pattern import verify_pattern
from common.transport import open_drafter_transport
from common.worker_runtime import WorkerLost, WorkerSession, sim_device

log = logging.getLogger("hsd.drafter")


def run_sim_drafter(config: Config, name: str) -> int:
    session = WorkerSession(config, "drafter", name)
    session.install_signal_handlers()
    cost = config.drafter.sim_cost_per_token
    num_steps = 0
    try:
        while not session.stop_requested.is_set():
            registration = session.register()
            accum_steps = registration["accum_steps"]
            transport = open_drafter_transport(registration["transport"], device=sim_device(registration["transport"]))
            window: list[int] = []
            busy_s = 0.0
            try:
                while not session.stop_requested.is_set():
                    reply = session.poll("get_hs")
                    job = reply["job"]
                    if job is not None:
                        started = time.perf_counter()
                        batch = transport.read(job["slot"], job["generation"], ipc=job.get("ipc"),
                                               owner=job.get("owner") or "")
                        session.call("consumed", job_id=job["job_id"])
                        verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens,
                                       job_id=job["job_id"], expected_seq_lens=job["lengths"])
                        time.sleep(cost * job["num_tokens"])
                        busy_s += time.perf_counter() - started
                        window.append(job["job_id"])
                    if window and (len(window) == accum_steps or reply["flush"] or reply["done"]):
                        session.call("commit_step", job_ids=window, busy_s=busy_s, checkpointed=True,
                                     verified=len(window))
                        num_steps += 1
                        window, busy_s = [], 0.0
                    if reply["done"]:
                        log.info("%s: run complete after %d steps", name, num_steps)
                        return 0
            except WorkerLost as exc:
                log.warning("%s: dispatcher lost track of us (%s); registering again", name, exc)
            finally:
                transport.close()
        return 0
    finally:
        session.close()
