"""Every drafter backend has every member of :class:`common.worker.backends.DrafterBackend`: the
drafter loop asks each of them of any backend and probes none."""

from __future__ import annotations

import pytest

from benchmarks.protocol_workers import BenchDrafter
from common.run.config import Config
from common.worker.backends import DrafterBackend
from drafter_worker.dflash_backend import DFlashBackend
from drafter_worker.eagle3_backend import Eagle3Backend
from drafter_worker.linear_backend import LinearDrafter
from drafter_worker.sim import SimDrafter

METHODS = [name for name in dir(DrafterBackend) if not name.startswith("_") and callable(getattr(DrafterBackend, name))]


@pytest.mark.parametrize("backend_class", [DFlashBackend, Eagle3Backend, BenchDrafter])
def test_the_trainers_and_the_benchmark_drafter_have_every_method(backend_class):
    assert METHODS and [name for name in METHODS if not callable(getattr(backend_class, name, None))] == []


def test_the_sim_and_linear_drafters_are_drafter_backends():
    config = Config()
    config.target.hidden_size = 8
    for backend in (SimDrafter(config.drafter, "drafter-0", dataset_path=None),
                    LinearDrafter("drafter-0", drafter=config.drafter, target=config.target, seed=0)):
        assert isinstance(backend, DrafterBackend), type(backend).__name__
