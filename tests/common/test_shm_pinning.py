"""Pinning the shm pool: a refused ``cudaHostRegister`` falls back to unpinned pages and leaves no
pending CUDA error behind.

The CUDA runtime is a fake here (the pool, its segment and its mapping are real): it records the
thread's last error the way the runtime does, which is the decision under test. That pinning
itself works is ``tests/common/test_cuda_ipc.py::test_shm_transport_with_cuda_workers``'s, on a GPU.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

from common.dataplane import shm_arena
from common.dataplane.shm_arena import SlotArena, list_segments
from common.dataplane.slots import SlotLayout

LAYOUT = SlotLayout(tokens_per_batch=256, num_layers=2, hidden_size=16, dtype="float32", max_seqs=4)
GPU = torch.device("cuda", 0)
HOST_MEMORY_ALREADY_REGISTERED = 712


class FakeRuntime:
    def __init__(self, register_error: int):
        self.register_error = register_error
        self.last_error = 0  # the runtime's per-thread last error, which a kernel launch check reads
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def host_register(self, ptr, nbytes, device):
        if self.register_error:
            self.last_error = self.register_error
            return self.register_error
        self.registered.append(ptr)
        return 0

    def host_unregister(self, ptr, device):
        self.unregistered.append(ptr)
        return 0

    def clear_last_error(self):
        err, self.last_error = self.last_error, 0
        return err

    def error_string(self, err):
        return f"error {err}"


@pytest.fixture
def run_id():
    run_id = uuid.uuid4().hex[:12]
    yield run_id
    assert not list_segments(run_id)


def test_a_refused_host_register_is_cleared_and_the_pool_stays_unpinned(monkeypatch, caplog, run_id) -> None:
    runtime = FakeRuntime(HOST_MEMORY_ALREADY_REGISTERED)
    monkeypatch.setattr(shm_arena, "cuda_host_runtime", lambda: runtime)
    with caplog.at_level(logging.WARNING, logger="common.dataplane.shm_arena"):
        with SlotArena.create(run_id, LAYOUT, 2, pin_device=GPU) as arena:
            assert not arena.pinned
            arena.slot(1).hs.fill_(1.0)  # the pages work unpinned
            assert runtime.last_error == 0, "the failed cudaHostRegister is left pending for the next kernel"
    assert runtime.unregistered == []
    assert any("could not pin" in r.getMessage() and "error 712" in r.getMessage() for r in caplog.records)


def test_a_pinned_pool_is_unpinned_on_close(monkeypatch, run_id) -> None:
    runtime = FakeRuntime(0)
    monkeypatch.setattr(shm_arena, "cuda_host_runtime", lambda: runtime)
    with SlotArena.create(run_id, LAYOUT, 2, pin_device=GPU) as arena:
        assert arena.pinned and len(runtime.registered) == 1
    assert runtime.unregistered == runtime.registered


def test_without_cuda_nothing_is_pinned(monkeypatch, run_id) -> None:
    monkeypatch.setattr(shm_arena, "cuda_host_runtime", lambda: None)
    with SlotArena.create(run_id, LAYOUT, 2, pin_device=GPU) as arena:
        assert not arena.pinned
