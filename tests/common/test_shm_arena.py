"""The shared-memory arena and the shm transport, with real processes and real /dev/shm segments."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from hsd_testing import child_message

from common.dataplane.shm_arena import SHM_DIR, SlotArena, check_fits, list_segments, sweep_dead_segments
from common.dataplane.shm_segment import dead_segments
from common.dataplane.slot_pattern import fill_pattern, verify_pattern
from common.dataplane.slots import SlotHeader, SlotLayout, SlotView, StaleSlotError, copy_out
from common.dataplane.transport import open_drafter_transport, open_target_transport, resolve_transport, shm_transport_info
from common.dataplane.transport_info import CudaHost
from common.run.descriptors import ShmInfo

REPO = Path(__file__).resolve().parents[2]
LAYOUT = SlotLayout(tokens_per_batch=512, num_layers=2, hidden_size=24, dtype="bfloat16", max_seqs=4)
TIMEOUT_S = 60


@pytest.fixture
def run_id():
    run_id = uuid.uuid4().hex[:12]
    yield run_id
    leftovers = list(Path(SHM_DIR).glob(f"hsd_{run_id}_*"))
    for path in leftovers:
        path.unlink()
    assert not leftovers, f"test left {leftovers} behind"


@pytest.fixture
def spawn_ctx(monkeypatch):
    """The spawn context; children import this module by name, which needs the repo root on sys.path."""
    monkeypatch.syspath_prepend(str(REPO))
    return multiprocessing.get_context("spawn")




def _fill(view: SlotView, job_id: int, generation: int) -> None:
    fill_pattern(view, job_id=job_id, generation=generation, bucket=128, batch_size=3, seq_len=128,
                 seq_lens=[128, 1, 77])


def _check(view: SlotView, job_id: int, generation: int) -> None:
    batch = copy_out(view, generation, torch.device("cpu"))
    verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=job_id)


def _worker(name: str, num_slots: int, to_parent, from_parent) -> None:
    arena = SlotArena.attach(name, LAYOUT, num_slots)
    _fill(arena.slot(0), job_id=7, generation=3)
    to_parent.put("filled")
    assert from_parent.get(timeout=TIMEOUT_S) == "parent wrote"
    # Still the views taken before the parent wrote: no re-attach, no copy.
    slot1 = arena.slot(1)
    to_parent.put(int(slot1.input_ids[5].item()))
    slot1.input_ids[6] = 4242
    to_parent.put("done")
    # Exit without close(): the finalizer unmaps, and nothing may unlink the segment.


def test_pattern_crosses_processes_zero_copy(run_id: str, spawn_ctx) -> None:
    ctx = spawn_ctx
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    with SlotArena.create(run_id, LAYOUT, 3) as arena:
        assert arena.nbytes == 3 * LAYOUT.slot_bytes == os.stat(arena.path).st_size
        slot1 = arena.slot(1)
        child = ctx.Process(target=_worker, args=(arena.name, 3, to_parent, from_parent))
        child.start()
        try:
            assert child_message(to_parent, child) == "filled"
            _check(arena.slot(0), job_id=7, generation=3)
            slot1.input_ids[5] = 31337
            from_parent.put("parent wrote")
            assert child_message(to_parent, child) == 31337
            assert child_message(to_parent, child) == "done"
            assert int(slot1.input_ids[6].item()) == 4242
            child.join(TIMEOUT_S)
            assert child.exitcode == 0
        finally:
            if child.is_alive():
                child.kill()
        assert os.path.exists(arena.path)  # the worker's exit did not remove it
        _check(arena.slot(0), job_id=7, generation=3)
    assert not os.path.exists(arena.path)


_ATTACH_AND_EXIT = """
import sys
from common.dataplane.shm_arena import SlotArena
from common.dataplane.slots import SlotLayout
layout = SlotLayout.from_dict({layout!r})
kept = SlotArena.attach(sys.argv[1], layout, 2)
assert kept.slot(1).read_header().job_id == 5
closed = SlotArena.attach(sys.argv[1], layout, 2)
closed.slot(1).input_ids[0] = 99
closed.close()
closed.close()
print("attached")
"""


def test_worker_exit_keeps_segment_and_prints_nothing(run_id: str) -> None:
    with SlotArena.create(run_id, LAYOUT, 2) as arena:
        _fill(arena.slot(1), job_id=5, generation=1)
        code = _ATTACH_AND_EXIT.format(layout=LAYOUT.to_dict())
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", code, arena.name], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "attached"
        assert proc.stderr == ""  # in particular no resource_tracker "leaked shared_memory" warning
        assert os.path.exists(arena.path)
        assert int(arena.slot(1).input_ids[0].item()) == 99


def _creator(run_id: str, to_parent) -> None:
    arena = SlotArena.create(run_id, LAYOUT, 1)
    to_parent.put(arena.name)
    time.sleep(TIMEOUT_S)


def test_sweep_removes_only_dead_creators(run_id: str, spawn_ctx) -> None:
    ctx = spawn_ctx
    to_parent = ctx.Queue()
    child = ctx.Process(target=_creator, args=(run_id, to_parent))
    child.start()
    sleeper = subprocess.Popen(["sleep", str(TIMEOUT_S)])
    try:
        dead_name = child_message(to_parent, child)
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT_S)
        # A live process whose pid appears in an older segment's name: the pid was reused.
        reused = Path(SHM_DIR, f"hsd_{run_id}_{sleeper.pid}")
        reused.write_bytes(b"")
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        with SlotArena.create(run_id, LAYOUT, 1) as live:
            assert {s.name for s in list_segments(run_id)} == {dead_name, reused.name, live.name}
            assert all(s.run_id == run_id for s in list_segments(run_id))
            assert sorted(sweep_dead_segments(run_id)) == sorted([dead_name, reused.name])
            assert [s.name for s in list_segments(run_id)] == [live.name]
            assert sweep_dead_segments(run_id) == []
    finally:
        sleeper.kill()
        sleeper.wait()
        if child.is_alive():
            child.kill()


@pytest.mark.serial  # `hsd cleanup --all-dead` removes every dead run's segments on the machine
def test_a_run_sweeps_only_its_own_dead_segments_and_cleanup_all_dead_takes_the_rest(run_id: str) -> None:
    other = uuid.uuid4().hex[:12]
    gone = subprocess.Popen(["true"])
    gone.wait()
    others = Path(SHM_DIR, f"hsd_{other}_{gone.pid}")  # its dispatcher exited without unlinking it
    others.write_bytes(b"")
    try:
        assert sweep_dead_segments(run_id) == []
        assert others.exists() and others.name in {s.name for s in dead_segments()}
        done = subprocess.run([sys.executable, "-m", "hsd.cli", "cleanup", "--all-dead"], cwd=REPO,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        assert not others.exists() and others.name in done.stdout
        both = subprocess.run([sys.executable, "-m", "hsd.cli", "cleanup"], cwd=REPO,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert both.returncode != 0 and "--all-dead" in both.stderr
    finally:
        others.unlink(missing_ok=True)


def test_check_fits_and_create_errors(run_id: str) -> None:
    with pytest.raises(ValueError, match=r"pool of 16 slots × .* does not fit: .*lower pool.slots"):
        check_fits(16, 1 << 46)
    with pytest.raises(ValueError, match="does not fit"):
        SlotArena.create(run_id, SlotLayout(tokens_per_batch=1 << 20, num_layers=64, hidden_size=8192,
                                            dtype="float32", max_seqs=1), 64)
    check_fits(2, LAYOUT.slot_bytes)
    with pytest.raises(ValueError, match="letters or digits"):
        SlotArena.create("../x", LAYOUT, 1)
    with pytest.raises(ValueError, match="not an hsdispatch segment"):
        SlotArena.attach("../../etc/passwd", LAYOUT, 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SlotArena.attach(f"hsd_{run_id}_1", LAYOUT, 1)
    with SlotArena.create(run_id, LAYOUT, 2) as arena:
        with pytest.raises(FileExistsError):
            SlotArena.create(run_id, LAYOUT, 2)
        with pytest.raises(ValueError, match="disagree on the layout"):
            SlotArena.attach(arena.name, LAYOUT, 3)


def test_close_and_unlink_are_idempotent_and_views_stay_valid(run_id: str) -> None:
    arena = SlotArena.create(run_id, LAYOUT, 2)
    worker = SlotArena.attach(arena.name, LAYOUT, 2)
    view = worker.slot(0)
    _fill(view, job_id=1, generation=9)
    worker.close()
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.slot(0)
    with pytest.raises(RuntimeError, match="only the creator"):
        worker.unlink()
    _check(view, job_id=1, generation=9)  # a view taken before close keeps its mapping
    arena.unlink()
    arena.unlink()
    assert not os.path.exists(arena.path)
    _check(arena.slot(0), job_id=1, generation=9)  # unlinking removes the name, not the mapping
    arena.close()


def test_shm_transport_round_trip(run_id: str) -> None:
    with SlotArena.create(run_id, LAYOUT, 3) as arena:
        info = shm_transport_info(arena)
        assert info == ShmInfo(arena=arena.name, num_slots=3, layout=LAYOUT)
        target = open_target_transport(info, "cpu")
        drafter = open_drafter_transport(info, "cpu")
        assert target.export() is None

        view = target.slot(2)
        _fill(view, job_id=21, generation=4)
        target.finish_write(2)
        batch = drafter.read(2, 4)
        verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=21)

        # A target that extracted real tensors hands them to write(); the header goes last.
        header = SlotHeader(generation=5, job_id=22, bucket=128, batch_size=3, seq_len=128, num_tokens=206)
        target.write(0, header, hs=batch.hs, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                     seq_lens=batch.seq_lens)
        copy = drafter.read(0, 5)
        assert copy.header == header
        verify_pattern(copy.hs, copy.input_ids, copy.loss_mask, copy.seq_lens, job_id=21)
        with pytest.raises(StaleSlotError):
            drafter.read(0, 4)
        with pytest.raises(ValueError, match="do not match"):
            target.write(0, header, hs=batch.hs[:2], input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                         seq_lens=batch.seq_lens)
        target.close()
        drafter.close()


def test_resolve_transport() -> None:
    one_gpu = CudaHost(1, lambda a, b: True)
    assert resolve_transport("auto", True, cuda=one_gpu, target_gpus=[0], drafter_gpus=[0]) == "cuda_ipc"
    assert resolve_transport("auto", True, cuda=one_gpu) == "shm"  # workers on the CPU
    assert resolve_transport("auto", True, cuda=None) == "shm"
    assert resolve_transport("auto", False, cuda=one_gpu, target_gpus=[0], drafter_gpus=[0]) == "shm"
    assert resolve_transport("shm", True, cuda=one_gpu) == "shm"
    assert resolve_transport("cuda_ipc", True, cuda=one_gpu) == "cuda_ipc"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_transport("cuda_ipc", True, cuda=None)
    with pytest.raises(ValueError, match="dispatcher's node"):
        resolve_transport("cuda_ipc", False, cuda=one_gpu)
    with pytest.raises(ValueError, match="not one of"):
        resolve_transport("tcp", True)
