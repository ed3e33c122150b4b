"""CUDA IPC slots across real processes (skipped without CUDA), and the CPU-side error paths."""

from __future__ import annotations

import dataclasses
import multiprocessing
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from hsd_testing import child_message

from common.dataplane.cuda_ipc import CudaIpcOpener, CudaSlotBlock, cuda_ipc_available
from common.dataplane.shm_arena import SHM_DIR, SlotArena
from common.dataplane.slot_pattern import fill_pattern, verify_pattern
from common.dataplane.slots import SlotLayout, StaleSlotError
from common.run.descriptors import CudaIpcExport
from common.dataplane.transport import (cuda_ipc_transport_info, open_drafter_transport, open_target_transport,
                              shm_transport_info)

REPO = Path(__file__).resolve().parents[2]
LAYOUT = SlotLayout(tokens_per_batch=1024, num_layers=3, hidden_size=32, dtype="bfloat16", max_seqs=8)
TIMEOUT_S = 120
needs_cuda = pytest.mark.skipif(not cuda_ipc_available(), reason="needs a CUDA device")


def _fill(view, job_id: int, generation: int) -> None:
    fill_pattern(view, job_id=job_id, generation=generation, bucket=256, batch_size=3, seq_len=256,
                 seq_lens=[256, 3, 100])


def _verify(batch, job_id: int) -> None:
    verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=job_id,
                   expected_seq_lens=[256, 3, 100])




def _drafter(wire_export: bytes, to_parent, from_parent) -> None:
    try:
        export = msgspec.msgpack.decode(wire_export, type=CudaIpcExport)
        opener = CudaIpcOpener(LAYOUT, "cuda:0")
        stream = torch.cuda.Stream("cuda:0")
        batch = opener.read_into(export, 1, 4, stream=stream, owner="target-0")
        assert batch.hs.device == torch.device("cuda", 0) and batch.header.job_id == 17
        _verify(batch, job_id=17)
        try:
            opener.read_into(export, 1, 3, stream=stream, owner="target-0")
            to_parent.put("stale read was not detected")
            return
        except StaleSlotError:
            pass
        to_parent.put("read")
        assert from_parent.get(timeout=TIMEOUT_S) == "rewritten"
        # The cached mapping sees the target's new job: the handle is opened once.
        _verify(opener.read_into(export, 1, 5, stream=stream, owner="target-0"), job_id=18)
        assert opener.num_open_blocks == 1
        del batch
        opener.close()
        to_parent.put("ok")
    except BaseException as exc:
        to_parent.put(f"{type(exc).__name__}: {exc}")


@needs_cuda
def test_export_open_and_read_in_another_process(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    ctx = multiprocessing.get_context("spawn")
    block = CudaSlotBlock(LAYOUT, 2, "cuda:0")
    _fill(block.slot(1), job_id=17, generation=4)
    block.finish_write(1)
    export = block.export()
    assert export == block.export()  # exported once, the same handle every time
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_drafter, args=(msgspec.msgpack.encode(export), to_parent, from_parent))
    child.start()
    try:
        assert child_message(to_parent, child) == "read"
        _fill(block.slot(1), job_id=18, generation=5)
        block.finish_write(1)
        from_parent.put("rewritten")
        assert child_message(to_parent, child) == "ok"
        child.join(TIMEOUT_S)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    block.close()


@needs_cuda
def test_cuda_ipc_transport_in_one_process() -> None:
    info = cuda_ipc_transport_info(LAYOUT, 2)
    target = open_target_transport(info, "cuda:0")
    drafter = open_drafter_transport(info, "cuda:0")
    _fill(target.slot(0), job_id=3, generation=8)
    target.finish_write(0)
    export = msgspec.msgpack.decode(msgspec.msgpack.encode(target.export()), type=CudaIpcExport)
    _verify(drafter.read(0, 8, ipc=export, owner="t0"), job_id=3)
    copy = drafter.start_read(0, 8, ipc=export, owner="t0")
    target.slot(0).begin_write()  # on the target's GPU, while the device-to-device copy may still run
    torch.cuda.synchronize()  # the target's store lands before the drafter's stream reads the header
    with pytest.raises(StaleSlotError, match="after"):
        copy.wait()
    _fill(target.slot(0), job_id=3, generation=8)
    target.finish_write(0)
    with pytest.raises(StaleSlotError):
        drafter.read(0, 7, ipc=export, owner="t0")
    with pytest.raises(ValueError, match="export"):
        drafter.read(0, 8)
    drafter.close()
    target.close()


@needs_cuda
def test_shm_transport_with_cuda_workers() -> None:
    run_id = uuid.uuid4().hex[:12]
    try:
        with SlotArena.create(run_id, LAYOUT, 2) as arena:
            info = shm_transport_info(arena)
            target = open_target_transport(info, "cuda:0")
            drafter = open_drafter_transport(info, "cuda:0")
            # The target extracts on its GPU and copies into pinned shared memory.
            scratch = CudaSlotBlock(LAYOUT, 1, "cuda:0")
            _fill(scratch.slot(0), job_id=12, generation=1)
            source = scratch.slot(0).batch(scratch.slot(0).read_header())
            header = dataclasses.replace(source.header, generation=2)
            target.write(1, header, hs=source.hs, input_ids=source.input_ids, loss_mask=source.loss_mask,
                         seq_lens=source.seq_lens)
            batch = drafter.read(1, 2)
            assert batch.hs.is_cuda
            _verify(batch, job_id=12)
            # The copy runs on the transport's own stream and completes by its event: waiting for it
            # does not wait for the compute queued before it (about a second of GPU sleep here).
            torch.cuda._sleep(2_000_000_000)
            overlapped = drafter.start_read(1, 2).wait()
            assert not torch.cuda.current_stream().query(), "the read waited for the compute stream"
            torch.cuda.synchronize()
            _verify(overlapped, job_id=12)
            # A writer that starts before the copy is waited for makes the wait fail.
            copy = drafter.start_read(1, 2)
            assert copy.event is not None and copy.stream != torch.cuda.current_stream()
            target.slot(1).begin_write()
            with pytest.raises(StaleSlotError, match="after"):
                copy.wait()
            target.close()
            drafter.close()
    finally:
        for path in Path(SHM_DIR).glob(f"hsd_{run_id}_*"):
            path.unlink()


def test_cuda_ipc_errors_without_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        CudaSlotBlock(LAYOUT, 2, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        CudaIpcOpener(LAYOUT, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        open_target_transport(cuda_ipc_transport_info(LAYOUT, 2), "cpu")
