"""Two ranks over gloo train exactly what one process accumulating the same micro-batches trains.

Real processes (spawn), a real FileStore rendezvous and gloo collectives. Each step, rank r trains
on its own micro-batches; the ranks exchange job ids (int64 rows, no pickle), sum gradients and
the supervised-position total, and divide once. After every step both ranks hold identical
weights, equal to those of one process that accumulated all of the step's micro-batches.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import torch
from safetensors.torch import load_file, save_file

from common.config import load_config
from common.slots import SlotBatch, SlotHeader

NUM_STEPS = 3
PER_RANK = 2  # micro-batches one rank brings to a step
WORLD = 2


def _config():
    return load_config(None, ["target.hidden_size=8", "target.num_capture_layers=2", "run.seed=7"])


def _micro_batch(job_id: int) -> SlotBatch:
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


def _jobs(step: int, rank: int) -> list[int]:
    first = step * WORLD * PER_RANK + rank * PER_RANK
    return list(range(first, first + PER_RANK))


def _rank_main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    from drafter_worker.linear_backend import LinearDrafter
    from drafter_worker.process_group import RankRound, StepGroup
    group = StepGroup(store_path=store, rank=rank, world_size=WORLD, version=1, timeout_s=120, max_jobs=PER_RANK)
    try:
        drafter = LinearDrafter(_config(), "m")
        for step in range(NUM_STEPS):
            mine = _jobs(step, rank)
            for job_id in mine:
                drafter.micro_batch({"job_id": job_id}, _micro_batch(job_id))
            rounds = group.exchange(RankRound(rank, mine, done=False, flush=False))
            step_jobs = [j for r in rounds for j in r.job_ids]
            drafter.sync_gradients(group.all_reduce)
            drafter.apply_step(step_jobs)
            save_file(drafter.state_dict(), os.path.join(out, f"rank{rank}-step{step}.safetensors"))
        assert sorted(drafter.trained) == list(range(NUM_STEPS * WORLD * PER_RANK))
    finally:
        group.close()


def test_two_ranks_match_one_process_accumulating_the_same_micro_batches(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, str(tmp_path / "store"), str(tmp_path)))
             for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=180)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()

    from drafter_worker.linear_backend import LinearDrafter
    torch.set_num_threads(1)
    single = LinearDrafter(_config(), "m")
    for step in range(NUM_STEPS):
        jobs = [j for rank in range(WORLD) for j in _jobs(step, rank)]
        for job_id in jobs:
            single.micro_batch({"job_id": job_id}, _micro_batch(job_id))
        single.apply_step(jobs)
        expected = single.state_dict()
        ranks = [load_file(str(tmp_path / f"rank{rank}-step{step}.safetensors")) for rank in range(WORLD)]
        for name, tensor in expected.items():
            assert torch.equal(ranks[0][name], ranks[1][name]), f"step {step}: {name} differs between ranks"
            torch.testing.assert_close(ranks[0][name], tensor, rtol=1e-5, atol=1e-6)
        assert not torch.equal(expected["weight"], LinearDrafter(_config(), "m").state_dict()["weight"])
