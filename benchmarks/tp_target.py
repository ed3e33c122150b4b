"""``hsd bench target --tp-sizes 1 2``: capture tokens/s per GPU of one target at each tensor-parallel size.

For each size a group is formed as ``hsd target`` forms it (rank 0 in a process of its own, started
here, which starts the other ranks) and captures the same jobs: ``--reps`` jobs of each bucket,
drawn (seeded) from the schedule of a lognormal length mix, after ``--warmup`` untimed ones. The
figure is real tokens ÷ the jobs' time ÷ tp_size: what one GPU of the group contributes. On GPUs a
group needs ``tp_size`` of them (``target.gpus``; ``hsd bench gpu``'s ``tp_target`` section picks
them); on the CPU every rank shares the host's cores, so the CPU figure says what the group costs in
collectives, not what it gains.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.run.config import Config, load_config, write_resolved


def _jobs(config: Config, *, reps: int, seed: int, num_samples: int, median: float, sigma: float):
    from benchmarks.target_capture import _job, _RandomSamples, _vocab_size, lognormal_lengths
    from common.run.records.schedule import build_epoch_schedule
    schedule_config = config.schedule
    lengths = lognormal_lengths(num_samples, median=median, sigma=sigma, max_len=schedule_config.buckets[-1], seed=seed)
    schedule = build_epoch_schedule(lengths, bucket_max_lens=schedule_config.buckets,
                                    tokens_per_batch=schedule_config.tokens_per_batch, run_seed=config.run.seed,
                                    epoch=0, order=schedule_config.order, batching=schedule_config.batching)
    rng = np.random.default_rng(seed)
    jobs = []
    for bucket in schedule.buckets:
        where = np.flatnonzero(schedule.job_bucket == bucket.id)
        if len(where):
            jobs += [_job(schedule, int(i), lengths) for i in rng.choice(where, size=min(reps, len(where)),
                                                                         replace=False)]
    return jobs, _RandomSamples(lengths, _vocab_size(config), seed)


def time_group(config_path: str, tp_size: int, *, warmup: int, reps: int, seed: int, num_samples: int,
               median: float, sigma: float) -> dict[str, Any]:
    """In rank 0's process: form the group, capture the jobs, time them."""
    import torch

    from common.dataplane.slots import SlotLayout, SlotView
    from target_worker.hf_backend import HFTargetBackend, default_device, pad_job
    from target_worker.tp_rank import start_group
    config = load_config(config_path, [f"target.tp_size={tp_size}"])
    jobs, dataset = _jobs(config, reps=reps, seed=seed, num_samples=num_samples, median=median, sigma=sigma)
    group = start_group(config, [sys.executable, "-m", "hsd.cli", "target", "--config", config_path,
                                 f"target.tp_size={tp_size}"]) if tp_size > 1 else None
    try:
        device = group.device if group is not None else default_device(config.target)
        backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective, device=device,
                                  dataset=dataset, group=group)
        layout = SlotLayout.from_contract(backend.contract, config.schedule)
        slot = SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8), layout)
        for job in jobs[:warmup]:
            backend.extract(job, slot)
        tokens, seconds = 0, 0.0
        for job in jobs:
            pad_job(job, dataset, tokens_per_batch=config.schedule.tokens_per_batch)  # built before the clock
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            written = backend.extract(job, slot)
            if written is not None:
                written.wait()
            seconds += time.perf_counter() - started
            tokens += sum(job.lengths)
        backend.close()
    finally:
        if group is not None:
            group.close()
    return {"tp_size": tp_size, "device": str(device), "jobs": len(jobs), "tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds, "tok_s_per_gpu": tokens / seconds / tp_size}


def bench_tp_target(config: Config, tp_sizes: list[int], *, warmup: int, reps: int, seed: int, num_samples: int,
                    median: float, sigma: float) -> dict[str, Any]:
    """Each size in a fresh rank 0 process (started here) on the same jobs."""
    from common.run.tensor_parallel import check_tensor_parallel
    for tp_size in tp_sizes:
        check_tensor_parallel(config.target.model, tp_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hsd-bench-tp-") as tmp:
        config_path = str(write_resolved(config, Path(tmp)))
        for tp_size in tp_sizes:
            argv = [sys.executable, "-m", "benchmarks.tp_target", config_path, str(tp_size),
                    json.dumps({"warmup": warmup, "reps": reps, "seed": seed, "num_samples": num_samples,
                                "median": median, "sigma": sigma})]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the tp_size={tp_size} group failed (exit {done.returncode}):\n"
                                   f"{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"model": config.target.model, "tokens_per_batch": config.schedule.tokens_per_batch,
            "lengths": {"median": median, "sigma": sigma, "samples": num_samples, "seed": seed}, "sizes": rows}


def format_tp_bench(result: dict[str, Any]) -> str:
    mix = result["lengths"]
    lines = [f"target {result['model']}: capture at each tensor-parallel size, {result['tokens_per_batch']} tokens "
             f"a batch, lognormal lengths (median {mix['median']:g}, sigma {mix['sigma']:g})",
             f"{'tp_size':>7}  {'device':<8}  {'jobs':>5}  {'tok/s':>10}  {'tok/s per GPU':>13}"]
    for row in result["sizes"]:
        lines.append(f"{row['tp_size']:>7}  {row['device']:<8}  {row['jobs']:>5}  {row['tok_s']:>10,.0f}  "
                     f"{row['tok_s_per_gpu']:>13,.0f}")
    return "\n".join(lines)


def run_tp_bench(config: Config, tp_sizes: list[int], *, as_json: bool, **options: Any) -> int:
    result = bench_tp_target(config, tp_sizes, **options)
    print(json.dumps(result, indent=2) if as_json else format_tp_bench(result))
    return 0


if __name__ == "__main__":  # rank 0 of one size, started by bench_tp_target: one JSON line out
    import logging
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(time_group(sys.argv[1], int(sys.argv[2]), **json.loads(sys.argv[3]))), flush=True)
