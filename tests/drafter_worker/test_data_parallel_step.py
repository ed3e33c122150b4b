"""Two ranks over gloo train exactly what one process accumulating the same micro-batches trains.

Real processes (spawn), a real FileStore rendezvous and gloo collectives. Each step, rank r trains
on its own micro-batches; the ranks exchange job ids (int64 rows, no pickle), sum gradients and
the supervised-position total, and divide once. After every step both ranks hold identical
weights, equal to those of one process that accumulated all of the step's micro-batches.
"""

from __future__ import annotations

import multiprocessing as mp

import torch
from safetensors.torch import load_file

from dp_ranks import NUM_STEPS, PER_RANK, WORLD, config, jobs, micro_batch, rank_main


def test_two_ranks_match_one_process_accumulating_the_same_micro_batches(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, str(tmp_path / "store"), str(tmp_path)))
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
    single = LinearDrafter(config(), "m")
    for step in range(NUM_STEPS):
        step_jobs = [j for rank in range(WORLD) for j in jobs(step, rank)]
        for job_id in step_jobs:
            single.micro_batch({"job_id": job_id}, micro_batch(job_id))
        single.apply_step(step_jobs)
        expected = single.state_dict()
        ranks = [load_file(str(tmp_path / f"rank{rank}-step{step}.safetensors")) for rank in range(WORLD)]
        for name, tensor in expected.items():
            assert torch.equal(ranks[0][name], ranks[1][name]), f"step {step}: {name} differs between ranks"
            torch.testing.assert_close(ranks[0][name], tensor, rtol=1e-5, atol=1e-6)
        assert not torch.equal(expected["weight"], LinearDrafter(config(), "m").state_dict()["weight"])
