"""drafter_worker/busy_clock.py on the CPU: a step's compute time is the host's time around its
micro-batches, reported once per closed step with the step it belongs to.

Each figure is bounded by what the test itself measured around the same micro-batches: at least
the time they slept, at most the wall time around them (however slow the machine is)."""

import time
from contextlib import contextmanager

import pytest

from drafter_worker.busy_clock import BusyClock

ROUNDING = 1e-9  # a sum of perf_counter differences against one difference


@contextmanager
def wall(spans: list[float]):
    """The wall time of the block, appended to ``spans``: it encloses the clock's own measurement."""
    started = time.perf_counter()
    try:
        yield
    finally:
        spans.append(time.perf_counter() - started)


def test_each_closed_step_reports_its_own_micro_batches_once():
    clock = BusyClock("cpu")
    outer_a: list[float] = []
    for _ in range(2):
        with wall(outer_a), clock.measure():
            time.sleep(0.02)
    clock.close_step(7)
    with clock.measure():
        time.sleep(0.01)
    clock.discard_open()  # a dropped step's micro-batches count for nothing
    clock.close_step(8)
    outer_b: list[float] = []
    with wall(outer_b), clock.measure():
        time.sleep(0.01)
    clock.close_step(9)
    (step_a, busy_a), (step_dropped, busy_dropped), (step_b, busy_b) = clock.completed()
    assert (step_a, step_dropped, step_b) == (7, 8, 9)
    assert 0.04 <= busy_a <= sum(outer_a) + ROUNDING
    assert busy_dropped == 0.0
    assert 0.01 <= busy_b <= outer_b[0] + ROUNDING
    assert clock.completed() == []  # each once
    clock.close_step(10)
    clock.reset()
    assert clock.completed() == []


def test_a_micro_batch_that_raises_is_still_measured():
    clock = BusyClock("cpu")
    outer: list[float] = []
    with pytest.raises(RuntimeError), wall(outer), clock.measure():
        time.sleep(0.01)
        raise RuntimeError("read failed")
    clock.close_step(1)
    [(step, busy)] = clock.completed()
    assert step == 1 and 0.01 <= busy <= outer[0] + ROUNDING
