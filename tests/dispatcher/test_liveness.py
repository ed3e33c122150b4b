"""dispatcher/liveness.py: a same-host worker whose process ended (SIGKILLed, a zombie not reaped yet
included) is dead to the sweep; its process is watched by the kernel, not asked every sweep."""

import select
import socket
import subprocess
import sys

import pytest

from dispatcher.core_types import Worker
from dispatcher.liveness import ProcessWatch, process_ended


def _worker(worker_id: str, pid: int, host: str | None = None) -> Worker:
    return Worker(worker_id, "target", worker_id, pid, host or socket.gethostname(), None, registered_at=0.0,
                  last_seen=0.0)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_worker_wakes_the_loop_and_is_dead_before_its_parent_reaps_it(sleeper):
    watch = ProcessWatch(socket.gethostname())
    try:
        worker = _worker("t0.0", sleeper.pid)
        assert watch.is_alive(worker)
        assert not select.select([watch.fileno()], [], [], 0)[0]  # a live process: nothing to wake for
        sleeper.kill()  # not waited for: a zombie
        assert select.select([watch.fileno()], [], [], 10)[0]  # the loop's poller wakes
        assert watch.collect()
        assert not watch.is_alive(worker)
        assert sleeper.poll() is not None  # reaped only now
        assert not watch.is_alive(worker)
        watch.forget_except([])
        assert not watch._watched and not watch._by_fd  # its descriptor closed
    finally:
        watch.close()


def test_a_zombie_or_gone_process_is_ended_where_no_pidfd_is_used(sleeper):
    watch = ProcessWatch(socket.gethostname(), use_pidfd=False)
    worker = _worker("t0.0", sleeper.pid)
    assert watch.fileno() is None and watch.is_alive(worker)
    sleeper.kill()
    deadline_checks = 0
    while watch.is_alive(worker) and deadline_checks < 1000:  # SIGKILL is asynchronous: a zombie within moments
        select.select([], [], [], 0.01)
        deadline_checks += 1
    assert not watch.is_alive(worker) and process_ended(sleeper.pid)  # a zombie, its parent has not waited
    sleeper.wait()
    assert process_ended(sleeper.pid)  # reaped: gone


def test_a_worker_of_another_host_is_alive_to_the_sweep_and_an_unknown_pid_is_not():
    watch = ProcessWatch(socket.gethostname())
    try:
        assert watch.is_alive(_worker("t0.0", 2 ** 22 + 7, host="elsewhere"))  # only heartbeats tell there
        assert not watch.is_alive(_worker("t1.0", 2 ** 22 + 7))  # beyond pid_max: no such process
    finally:
        watch.close()
