"""The nixl transport between two processes: a target's block on "node a", read locally by a reader of
node a (its segment mapped) and one-sided through NIXL over loopback TCP by a reader of node b, with
the generation check guarding both."""

from __future__ import annotations

import multiprocessing
import os
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from hsd_testing import child_message

from common.dataplane.shm_arena import SHM_DIR
from common.dataplane.slot_pattern import fill_pattern, verify_pattern
from common.dataplane.slots import SlotLayout, StaleSlotError
from common.dataplane.transport_info import engine_missing

REPO = Path(__file__).resolve().parents[2]
LAYOUT = SlotLayout(tokens_per_batch=512, num_layers=2, hidden_size=24, dtype="bfloat16", max_seqs=4)
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(engine_missing() is not None, reason="NIXL is not installed (make install adds it)")


def _owner(run_id: str, to_parent, from_parent) -> None:
    from common.dataplane.node_slots import NodeSlotBlock
    block = NodeSlotBlock(run_id, LAYOUT, 3, "a")
    fill_pattern(block.slot(2), job_id=9, generation=4, bucket=128, batch_size=3, seq_len=128, seq_lens=[128, 5, 60])
    to_parent.put(block.export())
    assert from_parent.get(timeout=TIMEOUT_S) == "rewrite"
    block.slot(2).begin_write()  # a new job takes the slot: generation 0 until published again
    to_parent.put("rewritten")
    assert from_parent.get(timeout=TIMEOUT_S) == "stop"
    block.close()


def test_slot_read_locally_and_across_nodes(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # loopback TCP, as between two plain hosts
    from common.dataplane.node_slots import NodeSlotReader
    run_id = uuid.uuid4().hex[:12]
    ctx = multiprocessing.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_owner, args=(run_id, to_parent, from_parent))
    child.start()
    local, remote = NodeSlotReader(LAYOUT, "a", torch.device("cpu")), NodeSlotReader(LAYOUT, "b", torch.device("cpu"))
    try:
        export = child_message(to_parent, child)
        assert export.node == "a" and isinstance(export.metadata, bytes)
        for reader in (local, remote):
            batch = reader.start_read(export, 2, 4, owner="t0").wait()
            verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=9,
                           expected_seq_lens=[128, 5, 60])
            with pytest.raises(StaleSlotError):
                reader.start_read(export, 2, 3, owner="t0")  # an older generation: refused before the copy
        assert (local.num_local, local.num_remote, remote.num_local, remote.num_remote) == (1, 0, 0, 1)  # refused reads do not count
        # A host that shares node a's name but not its memory (node a's config used there without
        # its own --node): the segment is not on it, so the slot is read through the engine.
        elsewhere = msgspec.structs.replace(export, arena=f"hsd_{run_id}_{os.getpid()}")  # a segment not on this host
        mixed = NodeSlotReader(LAYOUT, "a", torch.device("cpu"))
        try:
            batch = mixed.start_read(elsewhere, 2, 4, owner="t1").wait()
            verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=9,
                           expected_seq_lens=[128, 5, 60])
            assert (mixed.num_local, mixed.num_remote) == (0, 1)
        finally:
            mixed.close()
        from_parent.put("rewrite")
        assert child_message(to_parent, child) == "rewritten"
        for reader in (local, remote):
            with pytest.raises(StaleSlotError):
                reader.start_read(export, 2, 4, owner="t0").wait()
        with pytest.raises(IndexError):
            remote.start_read(export, 3, 4, owner="t0")
        local.forget(owner="t0")
        remote.forget(owner="t0")
        from_parent.put("stop")
        child.join(TIMEOUT_S)
        assert child.exitcode == 0
    finally:
        local.close()
        remote.close()
        if child.is_alive():
            child.kill()
            child.join(TIMEOUT_S)
        leftovers = list(Path(SHM_DIR).glob(f"hsd_{run_id}_*"))
        for path in leftovers:
            os.unlink(path)
    assert not leftovers, "the target left its segment behind"


@pytest.mark.parametrize("refuse", [False, True], ids=["pinned", "refused"])
def test_the_remote_read_buffer_is_pinned_where_cuda_is(refuse):
    """The slot every remote read lands in is page-locked at exactly its bytes where a CUDA runtime
    is (a recording stand-in for the runtime here: no GPU on this machine), pageable when refused."""
    from common.dataplane.nixl_engine import RemoteSlotReader
    from fake_cuda_runtime import FakeRuntime

    runtime = FakeRuntime(refuse=refuse)
    reader = RemoteSlotReader(LAYOUT, runtime=runtime)
    assert runtime.registered == [(reader.view.buffer.data_ptr(), LAYOUT.slot_bytes)]
    assert reader.pinned is not refuse and runtime.cleared == int(refuse)
    assert RemoteSlotReader(LAYOUT).pinned is False  # no CUDA here: pageable, nothing registered
