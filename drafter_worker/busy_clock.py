"""The compute time of a drafter's micro-batches, step by step, without making a GPU wait.

On the CPU the host computes, so a micro-batch's time is the host's wall time around it. On a GPU
the host only queues the work: its wall time says how fast Python launched kernels, not how long
the GPU computed. There the clock records a pair of CUDA events on the compute stream around each
micro-batch and reads them only once the step's last event has completed — usually at the next
step, after that step's one host read — so reading it never synchronises anything. A step's figure
therefore comes a step late on a GPU; callers get it with the step it belongs to.

The loop measures the micro-batch's compute alone, from after its slot's copy was waited for: a
start event queued before that wait would fire on an idle stream and count the wait as compute.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

import torch


class BusyClock:
    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._open_s = 0.0  # CPU: seconds of the step in progress
        self._open_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # GPU: its event pairs
        self._closed: deque[tuple[int, float | list]] = deque()  # (step, seconds or event pairs), oldest first
        self.last_host_s = 0.0  # the host's time in the last micro-batch (on a GPU: in queueing it)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Around one micro-batch's compute."""
        started = time.perf_counter()
        if not self.cuda:
            try:
                yield
            finally:
                self.last_host_s = time.perf_counter() - started
                self._open_s += self.last_host_s
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._open_events.append((start, end))
            self.last_host_s = time.perf_counter() - started

    def close_step(self, step: int) -> None:
        """The micro-batches measured since the last close belong to ``step`` (the caller's count)."""
        self._closed.append((step, self._open_events if self.cuda else self._open_s))
        self._open_s, self._open_events = 0.0, []

    def reset(self) -> None:
        """Forget everything measured (a new count of steps begins)."""
        self.discard_open()
        self._closed.clear()

    def discard_open(self) -> None:
        """Forget the micro-batches measured since the last close (their step was dropped)."""
        self._open_s, self._open_events = 0.0, []

    def completed(self) -> list[tuple[int, float]]:
        """(step, compute seconds) of the closed steps whose work has completed, oldest first;
        each is returned once. On the CPU every closed step has."""
        done = []
        while self._closed:
            step, measured = self._closed[0]
            if isinstance(measured, list):
                if measured and not measured[-1][1].query():
                    break  # the GPU is still on it: asked again at a later step
                measured = sum(start.elapsed_time(end) for start, end in measured) / 1000
            self._closed.popleft()
            done.append((step, measured))
        return done
