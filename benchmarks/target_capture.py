"""``hsd bench target``: slot fill and capture throughput on a lognormal length mix, per batching.

The lengths are what chat data looks like: lognormal with a long tail (``--median``, ``--sigma``,
``--samples``), capped at the largest bucket. Both batch formations of ``schedule.batching`` build
the epoch schedule on them (``fixed``: ``tokens_per_batch // L`` sequences padded to the bucket's
``L``; ``sorted``: batches of samples of nearly one length, padded to their longest), and for each:

- **fill** = real tokens ÷ slot tokens (``tokens_per_batch`` per job), per bucket and overall;
- the schedule's fairness figures on the same data (prefix deviation, tail skew);
- **capture throughput** in real tokens per second: ``--reps`` jobs drawn from each bucket of the
  schedule (seeded) are captured after ``--warmup`` runs, each bucket's time per job is the mean
  over them, and the overall figure is the epoch's real tokens ÷ the epoch's estimated time
  (Σ jobs of a bucket × its time per job).

For the run's own batching it also times the plain forward on the same jobs (what one would
otherwise write: ``model(ids, attention_mask=..., output_hidden_states=True)`` and a concatenation
of the wanted layers, every layer plus the LM head) and, on a GPU, each path's peak memory.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch

from common.run.config import Config
from common.run.records.schedule import BATCHINGS, EpochSchedule, build_epoch_schedule
from common.wire import messages
from target_worker.hf_backend import HFTargetBackend, PaddedBatch, default_device, pad_job


def lognormal_lengths(num_samples: int, *, median: float, sigma: float, max_len: int, seed: int) -> np.ndarray:
    """Chat-like lengths: lognormal around ``median``, rounded, within ``[1, max_len]``."""
    if num_samples <= 0 or median <= 0 or sigma < 0:
        raise ValueError(f"--samples and --median must be positive and --sigma >= 0, got {num_samples}, {median}, {sigma}")
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, num_samples)), 1, max_len).astype(np.int64)


class _RandomSamples:
    def __init__(self, lengths: np.ndarray, vocab_size: int, seed: int):
        self._lengths = lengths
        self._vocab_size = vocab_size
        self._seed = seed

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:  # made on demand: the mix has many samples
        n = int(self._lengths[index])
        ids = np.random.default_rng((self._seed, index)).integers(1, self._vocab_size, size=n)
        return ids, np.ones(n, dtype=np.uint8)


def _job(schedule: EpochSchedule, index: int, lengths: np.ndarray) -> messages.Job:
    samples = schedule.samples_of(index)
    job_lengths = lengths[samples].tolist()
    bucket = int(schedule.bucket_of(index))
    return messages.Job(job_id=index, epoch=0, bucket=bucket, seq_len=int(schedule.padded_len(bucket, job_lengths)),
                        samples=[int(i) for i in samples], lengths=job_lengths, num_tokens=sum(job_lengths), slot=0,
                        generation=1)


def schedule_fill(schedule: EpochSchedule, lengths: np.ndarray) -> dict[str, Any]:
    """Fill overall and per bucket (keyed by the bucket's max length), with the schedule's fairness figures."""
    fill, per_bucket = schedule.fill(lengths)
    buckets = {str(schedule.buckets[b].max_len): {"jobs": schedule.buckets[b].num_batches, "fill": f}
               for b, f in per_bucket.items()}
    return {"num_jobs": schedule.num_jobs, "real_tokens": int(lengths[schedule.job_samples].sum()), "fill": fill,
            **schedule.figures(), "buckets": buckets}


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _peak_bytes(fn, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def bench_target(config: Config, *, warmup: int = 1, reps: int = 3, seed: int = 0, num_samples: int = 20_000,
                 median: float = 400.0, sigma: float = 0.9) -> dict[str, Any]:
    if warmup < 0 or reps <= 0:
        raise ValueError(f"--warmup must be >= 0 and --reps positive, got {warmup} and {reps}")
    schedule_config = config.schedule
    lengths = lognormal_lengths(num_samples, median=median, sigma=sigma, max_len=schedule_config.buckets[-1], seed=seed)
    device = default_device(config.target)
    dataset = _RandomSamples(lengths, _vocab_size(config), seed)
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device=device, dataset=dataset, keep_full_model=True)
    layer_ids = list(backend.contract.layer_ids)
    model = backend.model

    def plain(batch: PaddedBatch) -> torch.Tensor:
        with torch.inference_mode():
            out = model(batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                        output_hidden_states=True, use_cache=False)
            return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)

    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, Any]] = {}
    for batching in BATCHINGS:
        schedule = build_epoch_schedule(lengths, bucket_max_lens=schedule_config.buckets,
                                        tokens_per_batch=schedule_config.tokens_per_batch, run_seed=config.run.seed,
                                        epoch=0, order=schedule_config.order, batching=batching)
        result = schedule_fill(schedule, lengths)
        with_plain = batching == schedule_config.batching
        epoch_s = 0.0
        for bucket in schedule.buckets:
            if not bucket.num_batches:
                continue
            where = np.flatnonzero(schedule.job_bucket == bucket.id)
            picked = rng.choice(where, size=min(reps, len(where)), replace=False)
            batches = [pad_job(_job(schedule, int(i), lengths), dataset, tokens_per_batch=schedule.tokens_per_batch)
                       for i in picked]
            runs = {"capture": backend.forward, **({"plain": plain} if with_plain else {})}
            for fn in runs.values():
                for _ in range(warmup):
                    _timed(lambda: fn(batches[0]), device)
            seconds = {name: 0.0 for name in runs}
            for batch in batches:  # interleaved, so drift in clock or cache state hits both alike
                for name, fn in runs.items():
                    seconds[name] += _timed(lambda: fn(batch), device)
            tokens = sum(int(b.seq_lens.sum()) for b in batches)
            row = result["buckets"][str(bucket.max_len)]
            row["shapes"] = [list(b.input_ids.shape) for b in batches]
            row["capture_tok_s"] = tokens / seconds["capture"]
            epoch_s += bucket.num_batches * seconds["capture"] / len(batches)
            if with_plain:
                row.update(plain_tok_s=tokens / seconds["plain"], speedup=seconds["plain"] / seconds["capture"])
                if device.type == "cuda":  # the other half of the gain: no layer outputs or logits kept alive
                    row.update({f"{name}_peak_gb": _peak_bytes(lambda: fn(batches[-1]), device) / 1e9
                                for name, fn in runs.items()})
        result["capture_tok_s"] = result["real_tokens"] / epoch_s
        results[batching] = result
    backend.close()
    ours = results[schedule_config.batching]
    return {"device": str(device), "dtype": backend.contract.dtype, "contract": backend.contract.to_dict(),
            "warmup": warmup, "reps": reps, "tokens_per_batch": schedule_config.tokens_per_batch,
            "lengths": {"distribution": "lognormal", "median": median, "sigma": sigma, "samples": num_samples,
                        "max_len": schedule_config.buckets[-1], "mean": float(lengths.mean()), "seed": seed},
            "batching": schedule_config.batching, "fill": ours["fill"], "buckets": ours["buckets"],
            "batchings": results,
            "capture_not_slower": all(b["capture_tok_s"] >= b["plain_tok_s"] for b in ours["buckets"].values())}


def _vocab_size(config: Config) -> int:
    from common.run.capture_contract import read_model_config
    doc = read_model_config(config.target.model)
    text = doc.get("text_config", doc) if "vocab_size" not in doc else doc
    return int(text.get("vocab_size", 1000))


def format_target_bench(result: dict[str, Any]) -> str:
    contract, mix = result["contract"], result["lengths"]
    lines = [f"target {contract['architecture']}  {contract['num_layers']} layers × {contract['hidden_size']} hidden  "
             f"capture {contract['layer_ids']}  {result['dtype']} on {result['device']}  "
             f"{result['tokens_per_batch']} tokens a batch",
             f"lengths: lognormal, median {mix['median']:g}, sigma {mix['sigma']:g}, {mix['samples']} samples capped "
             f"at {mix['max_len']} (mean {mix['mean']:.0f}); capture timed on {result['reps']} jobs a bucket",
             f"{'batching':>9}  {'jobs':>6}  {'fill':>5}  {'prefix dev':>10}  {'tail skew':>9}  {'capture tok/s':>13}  "
             "fill per bucket"]
    for batching, row in result["batchings"].items():
        per_bucket = " ".join(f"{seq_len}:{b['fill']:.2f}" for seq_len, b in row["buckets"].items())
        lines.append(f"{batching:>9}  {row['num_jobs']:>6}  {row['fill']:>5.3f}  {row['prefix_deviation']:>10.2f}  "
                     f"{row['tail_skew']:>9.4f}  {row['capture_tok_s']:>13,.0f}  {per_bucket}")
    lines.append(f"schedule.batching={result['batching']}, against the plain forward:")
    lines.append(f"{'bucket':>7}  {'capture tok/s':>14}  {'plain tok/s':>12}  {'speedup':>7}")
    for seq_len, row in result["buckets"].items():
        memory = (f"  peak {row['capture_peak_gb']:.1f} vs {row['plain_peak_gb']:.1f} GB"
                  if "capture_peak_gb" in row else "")
        lines.append(f"{seq_len:>7}  {row['capture_tok_s']:>14,.0f}  {row['plain_tok_s']:>12,.0f}  "
                     f"{row['speedup']:>6.2f}x{memory}")
    verdict = "yes" if result["capture_not_slower"] else "NO"
    lines.append(f"capture at least as fast as the plain forward at every bucket: {verdict}")
    return "\n".join(lines)


def run_target_bench(config: Config, *, as_json: bool, warmup: int, reps: int, **mix: Any) -> int:
    result = bench_target(config, warmup=warmup, reps=reps, **mix)
    print(json.dumps(result, indent=2) if as_json else format_target_bench(result))
    return 0
