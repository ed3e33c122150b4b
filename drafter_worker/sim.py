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
from common.transport import DrafterTransport, open_drafter_transport
from common.worker_runtime import WorkerSession, run_worker, sim_device

log = logging.getLogger("hsd.drafter")


def run_sim_drafter(config: Config, name: str) -> int:
    session = WorkerSession(config, "drafter", name)
    cost = config.drafter.sim_cost_per_token
    num_steps = 0

    def work(registration: dict, transport: DrafterTransport) -> None:
        nonlocal num_steps
        accum_steps = registration["accum_steps"]
        window: list[int] = []  # a fresh registration starts a fresh step: uncommitted work was given back
        busy_s = 0.0
        while not session.stop_requested.is_set():
            reply = session.poll("get_hs")
            job = reply["job"]
            if job is not None:
                started = time.perf_counter()
                batch = transport.read(job["slot"], job["generation"], ipc=job.get("ipc"), owner=job.get("owner") or "")
                if session.report("consumed", job_id=job["job_id"]) is None:
                    continue
                verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens,
                               job_id=job["job_id"], expected_seq_lens=job["lengths"])
                time.sleep(cost * job["num_tokens"])
                busy_s += time.perf_counter() - started
                window.append(job["job_id"])
            if window and (len(window) == accum_steps or reply["flush"]):
                if session.report("commit_step", job_ids=window, busy_s=busy_s, checkpointed=True,
                                  verified=len(window)) is not None:
                    num_steps += 1
                window, busy_s = [], 0.0
            if reply["done"]:
                log.info("%s: run complete after %d steps", name, num_steps)
                return

    return run_worker(session, lambda info: open_drafter_transport(info, device=sim_device(info)), work)
