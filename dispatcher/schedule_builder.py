"""Builds and writes the next epoch's schedule ahead of time, in a process of its own.

A million-job epoch takes seconds to order and write; done inside a request it would stall every
worker past its timeout, and done on a thread it would still hold the GIL the event loop needs. So
the dispatcher asks for epoch ``e + 1`` as soon as ``e`` starts, a child process builds it from the
run's lengths (``run_dir/lengths.npy``) and writes it, and the dispatcher only maps the finished
files when the epoch begins. ``inline=True`` builds in the caller (tests and tools).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dispatcher.schedule import build_epoch_schedule, load_schedule, save_schedule

LENGTHS_FILE = "lengths.npy"


@dataclass(frozen=True)
class ScheduleSpec:
    buckets: tuple[int, ...]
    tokens_per_batch: int
    run_seed: int
    order: str


def _die_with_parent() -> None:
    """Child-process initializer: a SIGKILLed dispatcher takes its builder with it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def build_and_save(run_dir: str, epoch: int, spec: ScheduleSpec) -> int:
    """Child-process entry: build epoch ``epoch`` from the run's lengths and write it; returns its job count."""
    existing = load_schedule(run_dir, epoch)
    if existing is not None:
        return existing.num_jobs
    lengths = np.load(Path(run_dir) / LENGTHS_FILE, mmap_mode="r")
    schedule = build_epoch_schedule(lengths, bucket_max_lens=list(spec.buckets), tokens_per_batch=spec.tokens_per_batch,
                                    run_seed=spec.run_seed, epoch=epoch, order=spec.order)
    if schedule.num_jobs == 0:
        raise ValueError("the schedule holds no job: every sample is longer than the last bucket")
    save_schedule(schedule, run_dir)
    return schedule.num_jobs


class ScheduleBuilder:
    def __init__(self, run_dir: str | os.PathLike, spec: ScheduleSpec, *, inline: bool = False):
        self.run_dir = str(run_dir)
        self.spec = spec
        self.inline = inline
        self._executor: ProcessPoolExecutor | None = None
        self._futures: dict[int, Future] = {}

    def request(self, epoch: int) -> None:
        """Start building ``epoch`` unless it is built or under way."""
        if epoch in self._futures:
            return
        if self.inline:
            future: Future = Future()
            try:
                future.set_result(build_and_save(self.run_dir, epoch, self.spec))
            except BaseException as exc:
                future.set_exception(exc)
        else:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                     initializer=_die_with_parent)
            future = self._executor.submit(build_and_save, self.run_dir, epoch, self.spec)
        self._futures[epoch] = future

    def ready(self, epoch: int) -> bool:
        """Whether ``epoch`` is written (raises what the build raised); requests it if nobody did."""
        self.request(epoch)
        future = self._futures[epoch]
        if not future.done():
            return False
        future.result()
        return True

    def wait(self, epoch: int) -> None:
        self.request(epoch)
        self._futures[epoch].result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
