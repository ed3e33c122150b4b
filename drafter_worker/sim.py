"""A simulated drafter: pulls ready hidden states, verifies their bytes, models the training cost.

It groups ``drafter.accum_steps`` micro-batches into one optimizer step and commits it; when the
dispatcher says nothing more is coming (``flush``) it commits a partial step. Any byte that
differs from the pattern the sim target wrote fails the worker loudly.

Its model state is the witness itself: the ids of the jobs its steps were applied on, saved with
each checkpoint under ``run_dir/models/<name>/`` and reloaded on start. Commit, then apply: a step
is applied only once the dispatcher acknowledged its commit.
"""

from __future__ import annotations

import logging
import time

from common.config import Config
from common.protocol import ErrorCode, ProtocolError
from common.slot_pattern import verify_pattern
from common.slots import StaleSlotError
from common.transport import DrafterTransport, open_drafter_transport
from common.witness import TrainedJobs, latest_checkpoint, save_checkpoint
from common.worker_runtime import WorkerSession, run_worker, sim_device

log = logging.getLogger("hsd.drafter")

CHECKPOINT_EVERY = 20


def run_sim_drafter(config: Config, name: str) -> int:
    model_id = name
    run_dir = config.run_dir
    latest = latest_checkpoint(run_dir, model_id)
    state = {"step": latest.step if latest else 0, "checkpointed": latest.step if latest else 0,
             "trained": latest.trained_jobs() if latest else TrainedJobs()}
    session = WorkerSession(config, "drafter", name)
    cost = config.drafter.sim_cost_per_token

    def checkpoint() -> None:
        save_checkpoint(run_dir, model_id, state["step"], state["trained"])
        state["checkpointed"] = state["step"]
        session.call("checkpoint", model=model_id, step=state["step"])

    def work(registration: dict, transport: DrafterTransport) -> None:
        accum_steps = registration["accum_steps"]
        window: list[int] = []  # a fresh registration starts a fresh step: uncommitted work was given back
        busy_s = 0.0
        while not session.stop_requested.is_set():
            reply = session.poll("get_hs")
            job = reply["job"]
            if job is not None:
                session.holding.add(job["job_id"])
                session.seen_grant = max(session.seen_grant, job["grant"])
                started = time.perf_counter()
                try:
                    batch = transport.read(job["slot"], job["generation"], ipc=job.get("ipc"),
                                           owner=job.get("owner") or "")
                except StaleSlotError as exc:
                    session.report("read_failed", job_id=job["job_id"], reason=str(exc))
                    session.holding.discard(job["job_id"])
                    continue
                if session.report("consumed", job_id=job["job_id"]) is None:
                    session.holding.discard(job["job_id"])
                    continue
                verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens,
                               job_id=job["job_id"], expected_seq_lens=job["lengths"])
                time.sleep(cost * job["num_tokens"])
                busy_s += time.perf_counter() - started
                window.append(job["job_id"])
            if window and (len(window) == accum_steps or reply["flush"]):
                step = state["step"] + 1
                if session.report("commit_step", model=model_id, step=step, job_ids=window, busy_s=busy_s,
                                  verified=len(window)) is not None:
                    state["trained"].add(window)
                    state["step"] = step
                    if step - state["checkpointed"] >= CHECKPOINT_EVERY:
                        checkpoint()
                session.holding.difference_update(window)
                window, busy_s = [], 0.0
            if not window and (reply["flush"] or reply["done"]) and state["step"] > state["checkpointed"]:
                checkpoint()
            if reply["done"]:
                log.info("%s: run complete at step %d", name, state["step"])
                return

    def register_model() -> dict:
        return {"id": model_id, "step": state["step"]}

    session.register_extra = lambda: {"model": register_model()}
    return run_worker(session, lambda info: open_drafter_transport(info, device=sim_device(info)), work)
