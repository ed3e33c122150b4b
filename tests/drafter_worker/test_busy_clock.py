"""drafter_worker/busy_clock.py on the CPU: a step's compute time is the host's time around its
micro-batches, reported once per closed step with the step it belongs to."""

import time

import pytest

from drafter_worker.busy_clock import BusyClock


def test_each_closed_step_reports_its_own_micro_batches_once():
    clock = BusyClock("cpu")
    for _ in range(2):
        with clock.measure():
            time.sleep(0.02)
    clock.close_step(7)
    with clock.measure():
        time.sleep(0.01)
    clock.discard_open()  # a dropped step's micro-batches count for nothing
    with clock.measure():
        time.sleep(0.01)
    clock.close_step(8)
    (step_a, busy_a), (step_b, busy_b) = clock.completed()
    assert (step_a, step_b) == (7, 8)
    assert busy_a == pytest.approx(0.04, abs=0.03) and busy_b == pytest.approx(0.01, abs=0.03) and busy_a > busy_b
    assert clock.completed() == []  # each once
    clock.close_step(9)
    clock.reset()
    assert clock.completed() == []


def test_a_micro_batch_that_raises_is_still_measured():
    clock = BusyClock("cpu")
    with pytest.raises(RuntimeError), clock.measure():
        time.sleep(0.01)
        raise RuntimeError("read failed")
    clock.close_step(1)
    [(step, busy)] = clock.completed()
    assert step == 1 and busy > 0
