"""The ranks of tests/drafter_worker/test_data_parallel_step.py: a module importable by name, so a
spawned child process can find its entry point.

Three backends train here: ``linear`` (:mod:`drafter_worker.linear_backend`), ``dflash`` (the real
DFlash drafter on the tiny target of :mod:`dflash_testing`) and ``eagle3`` (the EAGLE-3 drafter on the
same target, its draft vocabulary counted in a small prepared dataset under the test's directory). Every micro-batch is a fixed function
of its job id, and so are the DFlash anchors drawn on it (the anchor generator is reseeded from the
job id before each micro-batch): a rank and a single process that train on the same job draw the
same blocks, whatever came before it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from common.run.config import load_config
from common.dataplane.slots import SlotBatch, SlotHeader
from dflash_testing import LAYER_IDS, VOCAB, backend_config
from worker_jobs import held_job

NUM_STEPS = 3
PER_RANK = 2  # micro-batches one rank brings to a step
WORLD = 2
BACKENDS = ("linear", "dflash", "eagle3")
TARGET_HIDDEN = 64  # hidden size of dflash_testing.make_target's model


def config():
    return load_config(None, ["target.hidden_size=8", "target.num_capture_layers=2", "run.seed=7"])


def data_dir(out: str) -> str:
    """The prepared dataset an EAGLE-3 backend counts its vocabulary in (the test writes it first)."""
    return os.path.join(out, "data")


def make_backend(kind: str, target_dir: str | None, run_dir: str):
    if kind == "linear":
        from drafter_worker.linear_backend import LinearDrafter
        linear = config()
        return LinearDrafter("m", drafter=linear.drafter, target=linear.target, seed=linear.run.seed)
    from drafter_worker.factory import trainer_backend
    if kind == "eagle3":
        from drafter_worker.eagle3_backend import Eagle3Backend
        from eagle3_testing import backend_config as eagle3_config
        return trainer_backend(eagle3_config(target_dir, run_dir, data_dir(os.path.dirname(run_dir)), "run.seed=7"),
                               "m", backend_class=Eagle3Backend, device="cpu",
                               schedule_jobs=NUM_STEPS * WORLD * PER_RANK)
    from drafter_worker.dflash_backend import DFlashBackend
    return trainer_backend(backend_config(target_dir, run_dir, "run.seed=7"), "m", backend_class=DFlashBackend,
                           device="cpu", schedule_jobs=NUM_STEPS * WORLD * PER_RANK)


def weights(backend) -> dict[str, torch.Tensor]:
    if hasattr(backend, "trainer"):
        return {k: v.detach().clone() for k, v in backend.trainer.model.draft_state_dict().items()}
    return backend.state_dict()


def micro_batch(job_id: int, kind: str = "linear") -> SlotBatch:
    """A fixed micro-batch per job id: lengths, loss masks and labels all differ, so weights matter.

    For DFlash the captured states are as wide as the tiny target's capture layers, the token ids
    lie in its vocabulary and every sequence has supervised positions past a short prompt."""
    g = torch.Generator().manual_seed(1000 + job_id)
    if kind == "linear":
        batch_size, seq_len = 2 + job_id % 2, 6 + 3 * (job_id % 3)
        hs = torch.rand(batch_size, seq_len, 16, generator=g)
        ids = torch.randint(1, 100, (batch_size, seq_len), generator=g, dtype=torch.int32)
        lens = torch.randint(2, seq_len + 1, (batch_size,), generator=g, dtype=torch.int32)
        mask = (torch.rand(batch_size, seq_len, generator=g) < 0.7).to(torch.uint8)
    else:
        batch_size, seq_len, prompt_len = 2 + job_id % 2, 16 + 4 * (job_id % 3), 3
        width = (3 + 1 if kind == "eagle3" else len(LAYER_IDS)) * TARGET_HIDDEN  # EAGLE-3: 3 layers + final norm
        hs = torch.randn(batch_size, seq_len, width, generator=g)
        ids = torch.randint(1, VOCAB - 1, (batch_size, seq_len), generator=g, dtype=torch.int32)
        lens = torch.randint(prompt_len + 8, seq_len + 1, (batch_size,), generator=g, dtype=torch.int32)
        mask = torch.zeros(batch_size, seq_len, dtype=torch.uint8)
        for i, n in enumerate(lens.tolist()):
            mask[i, prompt_len:n] = (torch.rand(n - prompt_len, generator=g) < 0.8).to(torch.uint8)
            ids[i, n:] = 0  # padding
    header = SlotHeader(generation=1, job_id=job_id, bucket=0, batch_size=batch_size, seq_len=seq_len,
                        num_tokens=int(lens.sum()))
    return SlotBatch(hs, ids, mask, lens, header)


def train_on(backend, job_id: int, kind: str) -> None:
    """One micro-batch through the backend's own ``micro_batch`` (DFlash draws a job's anchors from
    the run seed and the job id, so a rank and the single process draw the same blocks)."""
    backend.micro_batch(held_job(job_id), micro_batch(job_id, kind))


def jobs(step: int, rank: int) -> list[int]:
    first = step * WORLD * PER_RANK + rank * PER_RANK
    return list(range(first, first + PER_RANK))


def rank_main(kind: str, rank: int, store: str, out: str, target_dir: str | None = None) -> None:
    torch.set_num_threads(1)
    from drafter_worker.process_group import RankRound, StepGroup
    from host_reads import HostReads
    group = StepGroup(store=store, rank=rank, world_size=WORLD, version=1, timeout_s=120, max_jobs=PER_RANK)
    try:
        drafter = make_backend(kind, target_dir, os.path.join(out, f"run{rank}"))
        for step in range(NUM_STEPS):
            mine = jobs(step, rank)
            host_reads = []  # by the backend's calls: the job exchange is the group's, and reads by design
            for job_id in mine:
                batch = micro_batch(job_id, kind)
                with HostReads() as reads:
                    drafter.micro_batch(held_job(job_id), batch)
                host_reads += reads.names
            rounds = group.exchange(RankRound(rank, mine, done=False, flush=False))
            step_jobs = [j for r in rounds for j in r.job_ids]
            with HostReads() as reads:
                drafter.sync_gradients(group.all_reduce)
                metrics = drafter.apply_step(step_jobs)
            host_reads += reads.names
            save_file(weights(drafter), os.path.join(out, f"rank{rank}-step{step}.safetensors"))
            with open(os.path.join(out, f"rank{rank}-step{step}.json"), "w") as f:
                json.dump({"loss": metrics["loss"], "host_reads": host_reads}, f)
        assert sorted(drafter.trained) == list(range(NUM_STEPS * WORLD * PER_RANK))
    finally:
        group.close()
