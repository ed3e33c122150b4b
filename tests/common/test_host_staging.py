"""A checkpoint's pinned host buffers: exactly the tensor's bytes, page-locked once and unlocked when
the buffer goes; a runtime that refuses leaves them pageable, its error cleared, said once. The
CUDA runtime (common.dataplane.shm_arena.CudaHostRuntime) is a fake here (no device on this machine): what is
checked is which calls are made, with which sizes, not that pinning works on a GPU. On the CPU the
copies are plain clones."""

from __future__ import annotations

import gc
import logging

import torch

from common.dataplane.host_staging import HostStaging, PinnedBuffer
from fake_cuda_runtime import FakeRuntime


DEVICE = torch.device("cuda", 0)


def test_a_buffer_is_exactly_its_tensor_page_locked_then_unlocked_when_it_goes():
    runtime = FakeRuntime()
    buffer = PinnedBuffer(torch.Size([1000, 3]), torch.bfloat16, DEVICE, runtime)
    ptr = buffer.tensor.data_ptr()
    # 6,000 bytes, not the 8,192 of the caching host allocator's power of two
    assert buffer.pinned and runtime.registered == [(ptr, 6000)]
    assert buffer.tensor.untyped_storage().nbytes() == 6000
    del buffer
    gc.collect()
    assert runtime.unregistered == [ptr]
    empty = PinnedBuffer(torch.Size([0, 4]), torch.float32, DEVICE, runtime)
    assert not empty.pinned and len(runtime.registered) == 1  # nothing to lock


def test_a_refused_registration_leaves_the_buffer_pageable_cleared_and_said_once(monkeypatch, caplog):
    runtime = FakeRuntime(refuse=True)
    monkeypatch.setattr(PinnedBuffer, "_refused_said", False)
    with caplog.at_level(logging.WARNING, logger="hsd.checkpoint"):
        buffers = [PinnedBuffer(torch.Size([64]), torch.float32, DEVICE, runtime) for _ in range(2)]
    assert not any(b.pinned for b in buffers) and len(runtime.registered) == 2
    assert runtime.cleared == 2  # the refusal does not wait for the next kernel launch to be reported
    assert caplog.text.count("cudaHostRegister of a 256-byte checkpoint buffer failed") == 1
    del buffers
    gc.collect()
    assert runtime.unregistered == []


def test_cpu_tensors_are_cloned():
    weights = {"w": torch.arange(6.0).view(2, 3)}
    copy = HostStaging().copy(weights)
    weights["w"].add_(1)
    assert copy["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
