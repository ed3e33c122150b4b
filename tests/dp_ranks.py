"""The ranks of tests/drafter_worker/test_data_parallel_step.py: a module importable by name, so a
spawned child process can find its entry point."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from common.config import load_config
from common.slots import SlotBatch, SlotHeader

NUM_STEPS = 3
PER_RANK = 2  # micro-batches one rank brings to a step
WORLD = 2


def config():
    return load_config(None, ["target.hidden_size=8", "target.num_capture_layers=2", "run.seed=7"])


def micro_batch(job_id: int) -> SlotBatch:
    """A fixed micro-batch per job id: lengths, loss masks and labels all differ, so weights matter."""
    g = torch.Generator().manual_seed(1000 + job_id)
    batch_size, seq_len = 2 + job_id % 2, 6 + 3 * (job_id % 3)
    hs = torch.rand(batch_size, seq_len, 16, generator=g)
    ids = torch.randint(1, 100, (batch_size, seq_len), generator=g, dtype=torch.int32)
    lens = torch.randint(2, seq_len + 1, (batch_size,), generator=g, dtype=torch.int32)
    mask = (torch.rand(batch_size, seq_len, generator=g) < 0.7).to(torch.uint8)
    header = SlotHeader(generation=1, job_id=job_id, bucket=0, batch_size=batch_size, seq_len=seq_len,
                        num_tokens=int(lens.sum()))
    return SlotBatch(hs, ids, mask, lens, header)


def jobs(step: int, rank: int) -> list[int]:
    first = step * WORLD * PER_RANK + rank * PER_RANK
    return list(range(first, first + PER_RANK))


def rank_main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    from drafter_worker.linear_backend import LinearDrafter
    from drafter_worker.process_group import RankRound, StepGroup
    group = StepGroup(store_path=store, rank=rank, world_size=WORLD, version=1, timeout_s=120, max_jobs=PER_RANK)
    try:
        drafter = LinearDrafter(config(), "m")
        for step in range(NUM_STEPS):
            mine = jobs(step, rank)
            for job_id in mine:
                drafter.micro_batch({"job_id": job_id}, micro_batch(job_id))
            rounds = group.exchange(RankRound(rank, mine, done=False, flush=False))
            step_jobs = [j for r in rounds for j in r.job_ids]
            drafter.sync_gradients(group.all_reduce)
            drafter.apply_step(step_jobs)
            save_file(drafter.state_dict(), os.path.join(out, f"rank{rank}-step{step}.safetensors"))
        assert sorted(drafter.trained) == list(range(NUM_STEPS * WORLD * PER_RANK))
    finally:
        group.close()
