"""``pool.transport=auto``: cuda_ipc only when every worker is on a GPU and their GPUs map each other.

The CUDA host is described by a fake :class:`CudaHost` (device count, peer access): the decision
is what is tested here, not that CUDA IPC works (``tests/common/test_cuda_ipc.py`` on a GPU).
"""

from __future__ import annotations

import logging
import uuid

import pytest

from common.run.config import load_config
from common.dataplane.shm_segment import list_segments
from common.run.slot_layout import SlotLayout
from common.dataplane.transport_info import CudaHost, choose_transport
from dispatcher import transport_setup
from dispatcher.transport_setup import DataPlane


def host(num_devices: int, *, no_peer: set[tuple[int, int]] = frozenset(), visible=None) -> CudaHost:
    return CudaHost(num_devices, lambda a, b: (a, b) not in no_peer, visible)


def test_auto_picks_cuda_ipc_only_with_every_worker_on_a_gpu() -> None:
    eight = host(8)
    kind, reason = choose_transport("auto", True, cuda=eight, target_gpus=[0, 1], drafter_gpus=[2])
    assert kind == "cuda_ipc" and "peer access" in reason
    # The first contact that crash-looped: a GPU host, CPU workers.
    assert choose_transport("auto", True, cuda=eight) == ("shm", "targets and drafters on the CPU (no target.gpus / "
                                                                  "drafter.gpus)")
    assert choose_transport("auto", True, cuda=eight, target_gpus=[0])[1].startswith("drafters on the CPU")
    assert choose_transport("auto", True, cuda=eight, drafter_gpus=[0])[1].startswith("targets on the CPU")
    assert choose_transport("auto", True, cuda=None, target_gpus=[0], drafter_gpus=[1]) == ("shm", "no CUDA on this host")
    assert choose_transport("auto", True, cuda=host(1), target_gpus=[0], drafter_gpus=[0])[0] == "cuda_ipc"


def test_auto_without_peer_access_or_a_gpu_it_cannot_see_picks_shm() -> None:
    kind, reason = choose_transport("auto", True, cuda=host(4, no_peer={(3, 1)}), target_gpus=[0, 1],
                                    drafter_gpus=[2, 3])
    assert (kind, reason) == ("shm", "no peer access from drafter GPU 3 to target GPU 1")
    # Only the drafter -> target direction matters (the drafter maps the target's block).
    assert choose_transport("auto", True, cuda=host(4, no_peer={(1, 3)}), target_gpus=[0, 1],
                            drafter_gpus=[2, 3])[0] == "cuda_ipc"
    assert choose_transport("auto", True, cuda=host(2), target_gpus=[0], drafter_gpus=[5]) == (
        "shm", "GPU 5 is not among the 2 this host shows the dispatcher")
    # target.gpus are physical ids; a dispatcher under CUDA_VISIBLE_DEVICES=4,6 sees them as 0 and 1.
    visible = host(2, no_peer={(1, 0)}, visible=(4, 6))
    assert choose_transport("auto", True, cuda=visible, target_gpus=[4], drafter_gpus=[6])[1] == (
        "no peer access from drafter GPU 6 to target GPU 4")
    assert choose_transport("auto", True, cuda=visible, target_gpus=[6], drafter_gpus=[4])[0] == "cuda_ipc"
    assert choose_transport("auto", True, cuda=visible, target_gpus=[0], drafter_gpus=[4])[0] == "shm"


def test_explicit_choices_are_kept() -> None:
    assert choose_transport("shm", True, cuda=host(8), target_gpus=[0], drafter_gpus=[1])[0] == "shm"
    assert choose_transport("cuda_ipc", True, cuda=host(1))[0] == "cuda_ipc"
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_transport("cuda_ipc", True, cuda=None)


def data_plane(config, run_id: str) -> DataPlane:
    """The data plane the dispatcher makes for ``config`` (dispatcher.build)."""
    return DataPlane.create(SlotLayout.from_config(config), config.pool, target=config.target,
                            drafter=config.drafter, nodes=config.nodes, run_id=run_id)


def test_the_dispatcher_logs_its_choice_and_reason_once(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(transport_setup, "probe_cuda_host", lambda: host(8))
    config = load_config(None, [f"run.dir={tmp_path}", "target.sim=true", "drafter.sim=true"])
    run_id = uuid.uuid4().hex[:12]
    with caplog.at_level(logging.INFO, logger="hsd.dispatcher"):
        plane = data_plane(config, run_id)
    try:
        assert plane.kind == "shm" and plane.arena is not None
        choices = [r.getMessage() for r in caplog.records if "pool.transport=auto" in r.getMessage()]
        assert choices == ["pool.transport=auto chose shm: targets and drafters on the CPU (no target.gpus / "
                           "drafter.gpus)"]
    finally:
        plane.close()
    assert not list_segments(run_id)
    gpu_config = load_config(None, [f"run.dir={tmp_path}", "target.gpus=[0]", "drafter.gpus=[1]"])
    gpu_plane = data_plane(gpu_config, uuid.uuid4().hex[:12])
    assert gpu_plane.kind == "cuda_ipc" and gpu_plane.arena is None
