"""hsd launch's supervisor: a crashed worker is restarted, one that exits EXIT_UNUSABLE is not.

Real child processes (a dispatcher stand-in that sleeps, workers that exit with a given code).
"""

from __future__ import annotations

import os
import sys

from common.run.config import load_config
from common.worker.runtime import EXIT_UNUSABLE
from ops.launch import Child, Launcher


def _child(name: str, role: str, code: int, max_restarts: int) -> Child:
    return Child(name, role, [sys.executable, "-c", f"raise SystemExit({code})"], dict(os.environ), max_restarts)


def test_an_unusable_worker_is_not_restarted_and_a_crashed_one_is(tmp_path):
    launcher = Launcher(load_config(None, [f"run.dir={tmp_path / 'run'}"]))
    launcher.log_dir.mkdir(parents=True)
    dispatcher = Child("dispatcher", "dispatcher", [sys.executable, "-c", "import time; time.sleep(60)"],
                       dict(os.environ), 0)
    unusable = _child("drafter-0", "drafter", EXIT_UNUSABLE, max_restarts=3)
    crashing = _child("target-0", "target", 1, max_restarts=2)
    launcher.children = [dispatcher, crashing, unusable]
    for child in launcher.children:
        launcher._start(child)
    try:
        assert launcher._supervise(dispatcher) == 1  # no drafter left: the run stops
    finally:
        launcher._stop_all(dispatcher)
    assert unusable.restarts == 0 and unusable.finished
    assert 0 < crashing.restarts <= 2
    assert dispatcher.process.poll() is not None
