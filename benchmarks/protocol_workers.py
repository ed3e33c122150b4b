"""The processes of ``hsd bench transport`` that speak the real protocol to a real dispatcher.

The shm path runs the one worker loop of every target and drafter (:mod:`common.worker.loop`)
with benchmark backends: the figures are those of the code a run uses. The round-trip probe drives
a session by hand instead, so that each figure is one request.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.transport_timeline import Stamps
from benchmarks.transport_workers import (POLL_MS, BenchSpec, Meter, _errors_to, _init_process, _scratch_slot,
                                          percentile)
from common.run.config import Config
from common.wire import messages
from drafter_worker.loop import DrafterLoop
from drafter_worker.sim import WitnessModel
from common.dataplane.slots import SlotBatch, SlotHeader, SlotView
from target_worker.loop import TargetLoop
from common.worker.runtime import DispatcherAddress, WorkerSession


# -- shm arena through the real protocol: benchmark backends on the one worker loop --------------
def _header_for(job: messages.Job) -> SlotHeader:
    return SlotHeader(generation=job.generation, job_id=job.job_id, bucket=job.bucket,
                      batch_size=len(job.samples), seq_len=job.seq_len, num_tokens=job.num_tokens)


class BenchTarget:
    """Writes a preallocated source into the slot (what a target's capture copy costs). Without
    ``write_hs`` only the header is published: the control-plane benchmark keeps the pool full
    without moving data."""

    contract = None
    device = None

    def __init__(self, spec: BenchSpec, write_hs: bool):
        self.src = _scratch_slot(spec.layout)
        self.write_hs = write_hs
        self.stamps = Stamps()

    def extract(self, job: messages.Job, slot: SlotView) -> None:
        header = _header_for(job)
        mark = self.stamps.mark
        mark(job.job_id, "write_start", cpu=True)
        slot.begin_write()
        if self.write_hs:
            rows, src = header.num_rows, self.src
            slot.hs[:rows].copy_(src.hs[:rows])
            slot.input_ids[:rows].copy_(src.input_ids[:rows])
            slot.loss_mask[:rows].copy_(src.loss_mask[:rows])
            slot.seq_lens[:header.batch_size].copy_(torch.tensor(job.lengths, dtype=torch.int32))
        mark(job.job_id, "write_end")
        slot.write_header(header)
        mark(job.job_id, "published")


class BenchDrafter(WitnessModel):
    """Counts the bytes the loop copied out (:class:`Meter`) and where the time between two
    micro-batches went: the copy (the loop's ``read_s``) or the control plane (the rest). Its model
    state is a real witness, as a drafter's is; it asks the loop to stop once the window is measured."""

    def __init__(self, spec: BenchSpec, model_id: str):
        super().__init__(model_id)
        self.meter = Meter(spec)
        self.row_bytes = spec.layout.row_width * spec.layout.itemsize
        self.loop: DrafterLoop | None = None
        self.copy_s = self.control_s = 0.0  # inside the window
        self._last: tuple[float, float] | None = None  # (time, loop.read_s) at the previous micro-batch
        self.num_micro_batches = 0  # warm-up included: every item the dispatcher handed out
        self._window: list[int] = []
        self.stamps = Stamps()

    def load_latest(self, run_dir: Any) -> int:
        return 0  # every benchmark run starts in a fresh run directory

    def micro_batch(self, job: messages.Job, batch: SlotBatch) -> None:
        assert self.loop is not None
        self.stamps.mark(job.job_id, "consumed")  # sent, or carried by the get_hs already in flight
        self.num_micro_batches += 1
        now, read_s = time.perf_counter(), self.loop.read_s
        num_counted = self.meter.num_items
        if self.meter.add(batch.header.num_rows * self.row_bytes):
            self.loop.request_stop()
        if self.meter.num_items > num_counted and self._last is not None:
            copy_s = read_s - self._last[1]
            self.copy_s += copy_s
            self.control_s += (now - self._last[0]) - copy_s
        self._last = (now, read_s)
        self._window.append(job.job_id)

    def apply_step(self, job_ids: list[int]) -> dict:
        self.trained.add(job_ids)
        self.step += 1
        self._window = []
        return {}

    def drop_step(self) -> None:
        self._window = []

    def result(self) -> dict[str, float]:
        result = self.meter.result()
        result.update(copy_gbps=self.meter.num_bytes / self.copy_s / 1e9,
                      control_ms=1e3 * self.control_s / self.meter.num_items, items_run=self.num_micro_batches,
                      timeline=self.stamps.export(), window_start_ns=self.meter.start_ns)
        return result


class _StampsGrants:
    """A worker loop that stamps when each grant arrived, as :attr:`grant_event`."""

    grant_event = ""
    backend: Any

    def _await_poll(self, request_id: int) -> messages.GrantReply:
        reply = super()._await_poll(request_id)  # type: ignore[misc]
        if reply.job is not None:
            self.backend.stamps.mark(reply.job.job_id, self.grant_event)
        return reply


class TimedTargetLoop(_StampsGrants, TargetLoop):
    """The target's loop, stamping its grants and when each job_ready went out."""

    grant_event = "target_granted"

    def _complete(self, pending: Any, transport: Any) -> None:
        super()._complete(pending, transport)
        self.backend.stamps.mark(pending.job.job_id, "reported")


class TimedDrafterLoop(_StampsGrants, DrafterLoop):
    """The drafter's loop, stamping its grants and when each copy started and ended."""

    grant_event = "granted"

    def _read(self, job: messages.Job, transport: Any, reports: list[int]) -> SlotBatch | None:
        self.backend.stamps.mark(job.job_id, "read_start", cpu=True)
        try:
            return super()._read(job, transport, reports)
        finally:
            self.backend.stamps.mark(job.job_id, "read_end")


def shm_target(config: Config, spec: BenchSpec, write_hs: bool, timeline: str | None, stop: Any,
               results: Any) -> None:
    """A target on the worker loop (get_job → write the slot → job_ready, the next get_job in flight:
    target_credits allows two slots), until stopped; its stamps saved to ``timeline`` as it exits."""
    _init_process()
    with _errors_to(results):
        backend = BenchTarget(spec, write_hs)
        loop = TimedTargetLoop.from_config(config, "bench-target", backend, external_stop=stop)
        loop.poll_ms = POLL_MS
        try:
            loop.run()
        finally:
            if timeline is not None:
                Path(timeline).write_text(json.dumps(backend.stamps.export()))


def shm_drafter(config: Config, spec: BenchSpec, stop: Any, results: Any) -> None:
    """A drafter on the worker loop: get_hs (the next one in flight) → ``DrafterTransport.read`` →
    consumed, and a commit every ``accum_steps`` items, until the measured window is complete."""
    _init_process()
    with _errors_to(results):
        backend = BenchDrafter(spec, "bench-drafter")
        loop = TimedDrafterLoop.from_config(config, "bench-drafter", backend, external_stop=stop)
        backend.loop = loop
        loop.run()
        results.put(backend.result())


def rtt_drafter(config: Config, spec: BenchSpec, num_cycles: int, stop: Any, results: Any) -> None:
    """Time a drafter's control cycle (no data copy) while a target keeps the pool full: one get_hs
    carrying the consumed report of the slot the previous cycle got, as a drafter sends it.

    get_hs is sent with ``wait_ms=0``: a cycle that finds no ready slot is not timed (it would
    measure the target, not the control plane) but counted as ``waited`` and served untimed.
    Every ``drafter.accum_steps`` cycles the consumed jobs are committed, as a drafter commits its
    step; commit_step (journaled with fsync) is timed separately. A measuring probe, not a worker: it
    drives the session by hand, one request at a time, so every figure is one round trip.
    """
    _init_process()
    with _errors_to(results):
        session = WorkerSession(DispatcherAddress.from_config(config), "drafter", "bench-rtt-drafter")
        model = "bench-rtt-drafter"
        step = session.register(model=messages.ModelClaim(id=model, step=0)).model_step or 0
        num_warmup = max(20, num_cycles // 20)
        cycle_ms: list[float] = []
        commit_ms: list[float] = []
        num_waited = num_run = 0
        carried: list[int] = []  # the previous cycle's job: consumed by this cycle's get_hs
        step_jobs: list[int] = []  # consumed since the last commit
        try:
            while len(cycle_ms) < num_cycles and not stop.is_set():
                started = time.perf_counter()
                reply = session.call(messages.GetHS(wait_ms=0, consumed=carried))
                step_jobs += carried
                carried = []
                waited = reply.job is None
                if waited:
                    if reply.done:
                        raise RuntimeError("the benchmark dispatcher ran out of jobs: raise data.synthetic_samples")
                    reply = session.call(messages.GetHS(wait_ms=1000), timeout_s=11.0)
                    if reply.job is None:
                        continue
                answered = time.perf_counter()
                carried = [reply.job.job_id]
                num_run += 1
                commit_s = None
                if len(step_jobs) >= config.drafter.accum_steps:
                    session.call(messages.CommitStep(model=model, step=step + 1, job_ids=step_jobs, busy_s=0.0))
                    commit_s = time.perf_counter() - answered
                    step += 1
                    step_jobs = []
                if num_warmup:
                    num_warmup -= 1
                    continue
                if waited:
                    num_waited += 1
                else:
                    cycle_ms.append(1e3 * (answered - started))
                if commit_s is not None:
                    commit_ms.append(1e3 * commit_s)
        finally:
            session.close()
        results.put({"rtt_p50_ms": percentile(cycle_ms, 50), "rtt_p99_ms": percentile(cycle_ms, 99),
                     "commit_rtt_p50_ms": percentile(commit_ms, 50), "commit_rtt_p99_ms": percentile(commit_ms, 99),
                     "rtt_cycles": len(cycle_ms), "rtt_waited": num_waited, "rtt_commits": len(commit_ms),
                     "rtt_cycles_run": num_run})  # warm-up and waited cycles too
