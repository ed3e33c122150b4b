"""Rank 0 of a tensor-parallel target group, as a script: start the group (rank 1.. run ``hsd target
--tp-rank``), extract jobs of random samples into slots, save every slot's bytes to a file.

    python tests/tp_target_slots.py CONFIG_YAML OUT_PT SEED LENGTHS JOB [JOB ...]

LENGTHS and each JOB are comma-separated: sample lengths; a job's sample indices, then ``/seq_len``.
"""

from __future__ import annotations

import sys

import torch

from common.dataplane.slots import SlotLayout, SlotView
from common.run.config import load_config
from target_worker.hf_backend import HFTargetBackend
from target_worker.tp_rank import start_group
from tiny_target import random_samples
from worker_jobs import held_job


def extract_jobs(backend: HFTargetBackend, config, lengths: list[int], jobs) -> list[SlotView]:
    """Each JOB (``indices/seq_len``) extracted by ``backend`` into a slot of its own, in order."""
    layout = SlotLayout.from_contract(backend.contract, config.schedule)
    slots = []
    for job_id, text in enumerate(jobs):
        samples, _, seq_len = text.partition("/")
        indices = [int(i) for i in samples.split(",")]
        slot = SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8), layout)
        backend.extract(held_job(job_id, samples=indices, lengths=[lengths[i] for i in indices],
                                 seq_len=int(seq_len), generation=job_id + 1), slot)
        slots.append(slot)
    return slots


def main(config_path: str, out: str, seed: str, lengths_text: str, *jobs: str) -> int:
    config = load_config(config_path, [])
    lengths = [int(n) for n in lengths_text.split(",")]
    dataset = random_samples(lengths, seed=int(seed))
    group = start_group(config, [sys.executable, "-m", "hsd.cli", "target", "--config", config_path])
    try:
        backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                                  device="cpu", dataset=dataset, group=group)
        weight = backend.model.model.layers[0].self_attn.q_proj.weight
        assert type(weight).__name__ == "DTensor", f"the target did not load sharded: {type(weight)}"
        torch.save([slot.buffer.clone() for slot in extract_jobs(backend, config, lengths, jobs)], out)
        backend.close()
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
