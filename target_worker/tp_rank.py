"""The two ends of a tensor-parallel target group as ``hsd target`` runs them.

:func:`start_group` is rank 0's: it starts the other ranks and joins the group with them, before it
loads its shard and registers with the dispatcher. :func:`run_rank` is the whole life of a rank
other than 0 (``hsd target --tp-rank r --tp-store HOST:PORT``, started by rank 0): join, load its
shard, then run the forward of every batch rank 0 shares until rank 0 says stop (exit 0) or the
group is lost (exit 1: rank 0, or its death, restarts the group).
"""

from __future__ import annotations

import logging
import signal

from common.run.config import Config
from target_worker.tp_group import TargetGroup, TargetGroupLost, rank_device

log = logging.getLogger("hsd.target")


def start_group(config: Config, rank_command: list[str]) -> TargetGroup:
    """Rank 0: the group of ``target.tp_size`` ranks, joined (the other ranks run ``rank_command``)."""
    target = config.target
    return TargetGroup.start(size=target.tp_size, rank_command=rank_command, device=rank_device(0, target.gpus),
                             timeout_s=target.tp_timeout_s, run_dir=str(config.run_dir), gpus=target.gpus)


def run_rank(config: Config, rank: int, store_address: str) -> int:
    from target_worker.hf_backend import HFTargetBackend
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # rank 0 stops it: nothing of its own to save
    target = config.target
    if not 0 < rank < target.tp_size:
        raise ValueError(f"--tp-rank {rank}: a group of target.tp_size={target.tp_size} has ranks "
                         f"1..{target.tp_size - 1} besides rank 0 (the hsd target that starts them)")
    group = TargetGroup.join(rank=rank, size=target.tp_size, store_address=store_address,
                             device=rank_device(rank, target.gpus), timeout_s=target.tp_timeout_s,
                             run_dir=str(config.run_dir))
    clean = False
    try:
        backend = HFTargetBackend(target, config.schedule, objective=config.drafter.objective, device=group.device,
                                  dataset=None, group=group)
        log.info("rank %d of the target group: shard loaded on %s", rank, group.device)
        while True:
            try:
                batch = group.next_batch()
            except (RuntimeError, OSError) as exc:  # rank 0's store is gone: so is the group
                log.warning("rank %d of the target group: rank 0 is gone (%s): leaving", rank, exc)
                return 1
            if batch is None:
                clean = True
                log.info("rank %d of the target group: %d jobs run, leaving", rank, group.jobs_run)
                return 0
            try:
                backend.follow(batch)
            except TargetGroupLost as exc:
                log.warning("%s: leaving", exc)
                return 1
    finally:
        group.close(clean=clean)
