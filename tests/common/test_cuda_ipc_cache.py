"""The CUDA IPC opener's decisions on the CPU, under a fake CUDA layer: which export is opened
through IPC, when a departed target's block is released, what a failed peer mapping raises.

The fake stands in for the two CUDA calls only (``_cuda_device`` and ``_map_ipc_block``): a
"mapped" block is a CPU tensor holding a real slot. The targets are real processes, so that
"departed" is judged on real pids. That CUDA IPC itself works is ``tests/common/test_cuda_ipc.py``'s,
on a GPU.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import weakref

import pytest
import torch

from common.dataplane import cuda_ipc
from common.dataplane.cuda_ipc import CudaIpcOpener, CudaSlotBlock, PeerMappingError
from common.dataplane.slot_pattern import fill_pattern
from common.dataplane.slots import SlotLayout, SlotView
from common.dataplane.transport import DrafterTransport
from common.run.descriptors import CudaIpcExport

LAYOUT = SlotLayout(tokens_per_batch=256, num_layers=2, hidden_size=16, dtype="float32", max_seqs=4)
CPU = torch.device("cpu")


class FakeDriver:
    """Maps an export to a CPU tensor holding one written slot; refuses what the test tells it to."""

    def __init__(self):
        self.mapped: list[str] = []
        self.blocks: dict[str, weakref.ref] = {}
        self.refuse = ""

    def map(self, index, export):
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.mapped.append(export.block_id)
        block = torch.zeros(export.num_slots * LAYOUT.slot_bytes, dtype=torch.uint8)
        fill_pattern(SlotView(block[:LAYOUT.slot_bytes], LAYOUT), job_id=1, generation=1, bucket=64, batch_size=1,
                     seq_len=64, seq_lens=[64])
        self.blocks[export.block_id] = weakref.ref(block)
        return block


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_ipc, "_cuda_device", lambda device: CPU)
    monkeypatch.setattr(cuda_ipc, "_map_ipc_block", fake.map)
    return fake


def export_of(pid: int, block_id: str) -> CudaIpcExport:
    return CudaIpcExport(block_id=block_id, host=socket.gethostname(), pid=pid, device_index=0, device_uuid=None,
                         handle=block_id.encode(), storage_bytes=2 * LAYOUT.slot_bytes, storage_offset=0,
                         num_slots=2, slot_bytes=LAYOUT.slot_bytes)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_an_export_of_this_process_is_read_from_its_block_not_opened(driver) -> None:
    driver.refuse = "invalid device context"  # what the driver answers when the exporter opens its own handle
    block = CudaSlotBlock(LAYOUT, 2, "cpu")
    fill_pattern(block.slot(1), job_id=7, generation=3, bucket=64, batch_size=1, seq_len=64, seq_lens=[64])
    opener = CudaIpcOpener(LAYOUT, "cpu")
    export = export_of(os.getpid(), block.block_id)
    assert opener.open(export, owner="t0") is block.buffer and driver.mapped == []
    assert opener.read_into(export, 1, 3, owner="t0").header.job_id == 7
    block.close()
    opener.close()
    with pytest.raises(RuntimeError, match="of this process is closed"):
        opener.open(export, owner="t0")


def test_a_peer_mapping_the_driver_refuses_is_a_peer_mapping_error(driver) -> None:
    driver.refuse = "peer access is not supported between these two devices"
    opener = CudaIpcOpener(LAYOUT, "cpu")
    with pytest.raises(PeerMappingError, match="peer access is not supported.*use pool.transport=shm"):
        opener.open(export_of(os.getppid(), "b1"), owner="t0")
    assert opener.num_open_blocks == 0


def test_blocks_of_dead_and_re_registered_targets_are_released(driver) -> None:
    first, second, third = sleeper(), sleeper(), None
    try:
        transport = DrafterTransport("cuda_ipc", LAYOUT, CPU, opener=CudaIpcOpener(LAYOUT, "cpu"))
        a, b = export_of(first.pid, "a"), export_of(second.pid, "b")
        assert transport.read(0, 1, ipc=a, owner="w1").header.job_id == 1
        transport.read(0, 1, ipc=b, owner="w2")
        transport.read(0, 1, ipc=a, owner="w1")  # cached: opened once
        assert driver.mapped == ["a", "b"] and transport._opener.num_open_blocks == 2
        # target w1 dies; its restart registers as w3 with a new block, in a new process
        first.kill()
        first.wait()
        third = sleeper()
        transport.read(0, 1, ipc=export_of(third.pid, "c"), owner="w3")
        gc.collect()
        assert driver.blocks["a"]() is None, "the dead target's block is still mapped"
        assert transport.num_released == 1 and transport._opener.num_open_blocks == 2
        # w2 registers again from the same process (its lease lapsed): a new worker id, a new block
        transport.read(0, 1, ipc=export_of(second.pid, "d"), owner="w4")
        gc.collect()
        assert driver.blocks["b"]() is None and driver.blocks["d"]() is not None
        assert transport.num_released == 2 and transport._opener.num_open_blocks == 2
        # w3's process dies: released at the next sweep, though nothing new is opened
        third.kill()
        third.wait()
        transport.read(0, 1, ipc=export_of(second.pid, "d"), owner="w4")
        assert driver.blocks["c"]() is not None  # not before the sweep is due
        transport._next_sweep = 0.0
        transport.read(0, 1, ipc=export_of(second.pid, "d"), owner="w4")
        gc.collect()
        assert driver.blocks["c"]() is None and transport._opener.num_open_blocks == 1
        assert transport.num_released == 3 and driver.mapped == ["a", "b", "c", "d"]
        transport.close()
    finally:
        for proc in (first, second, third):
            if proc is not None:
                proc.kill()
                proc.wait()
