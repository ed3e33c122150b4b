"""The socket loop's CPU booking: each stretch of the thread's CPU time goes to the name charged."""

from __future__ import annotations

import threading
import time

from dispatcher.loop_cpu import LoopCpu


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_each_charge_books_the_threads_cpu_since_the_last_one():
    cpu = LoopCpu()
    _burn(0.02)
    cpu.charge("get_job")
    time.sleep(0.05)  # asleep: no CPU of this thread
    cpu.charge("poll")
    _burn(0.01)
    cpu.charge("get_job")
    seconds = cpu.seconds()
    assert set(seconds) == {"get_job", "poll"}
    assert seconds["get_job"] >= 0.03
    assert seconds["poll"] < seconds["get_job"] / 3


def test_another_threads_cpu_is_not_booked():
    cpu = LoopCpu()
    other = threading.Thread(target=_burn, args=(0.05,))
    other.start()
    other.join()
    cpu.charge("poll")
    assert cpu.seconds()["poll"] < 0.02

