"""A drafter whose GPU cannot map a target's cuda_ipc block gives the job back and leaves for good.

Against the scripted dispatcher (real sockets and shared memory, the real sim drafter). The read
of one slot raises what :class:`common.dataplane.cuda_ipc.CudaIpcOpener` raises when the driver refuses the
peer mapping (the fake CUDA layer here); what is tested is the loop's answer to it.
"""

from __future__ import annotations

import threading

import pytest

from common.wire.client import run_id_for
from common.dataplane.cuda_ipc import PeerMappingError
from common.dataplane.transport import DrafterTransport
from common.worker.runtime import EXIT_UNUSABLE, WorkerUnusable
from drafter_worker.loop import DrafterLoop
from drafter_worker.sim import SimDrafter
from hsd import cli
from loop_harness import FakeDispatcher, worker_config


@pytest.fixture
def fake(tmp_path):
    dispatcher = FakeDispatcher(f"ipc://{tmp_path / 'control.sock'}", run_id_for(tmp_path / "run"))
    yield dispatcher
    dispatcher.close()


def test_a_refused_peer_mapping_gives_the_job_back_and_ends_the_drafter(tmp_path, fake, monkeypatch):
    fake.add_ready_job(1, slot=0)
    fake.add_ready_job(2, slot=1)
    read = DrafterTransport.start_read

    def start_read(self, slot_id, generation, **kwargs):
        if slot_id == 1:
            raise PeerMappingError("cannot map the CUDA IPC block of target pid 1 onto cuda:0: peer access is not "
                                   "supported between these two devices; use pool.transport=shm")
        return read(self, slot_id, generation, **kwargs)
    monkeypatch.setattr(DrafterTransport, "start_read", start_read)
    config = worker_config(tmp_path / "run", fake.endpoint)
    backend = SimDrafter(config.drafter, model_id="drafter-0", dataset_path=None)
    loop = DrafterLoop.from_config(config, "drafter-0", backend)
    loop.poll_ms = 100
    raised: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:  # noqa: BLE001 - what the process would exit with
            raised.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the drafter kept going after a peer mapping failed"
    assert len(raised) == 1 and isinstance(raised[0], WorkerUnusable) and "pool.transport=shm" in str(raised[0])
    assert [e.request.job_id for e in fake.ops("read_failed")] == [2]
    assert "peer access" in fake.ops("read_failed")[0].request.reason
    assert [e.request.job_id for e in fake.ops("consumed")] == [1]


def test_an_unusable_worker_exits_with_the_code_launch_does_not_restart(monkeypatch, capsys):
    def unusable(args):
        raise WorkerUnusable("drafter-0: cannot map the target's block")
    monkeypatch.setattr(cli, "cmd_worker", unusable)
    assert cli.main(["drafter", "--sim"]) == EXIT_UNUSABLE == 78
    assert "cannot map the target's block" in capsys.readouterr().err
