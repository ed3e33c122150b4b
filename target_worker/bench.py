"""``hsd bench target``: capture throughput at each bucket's fixed shape vs a plain HF forward.

The plain forward is what one would otherwise write to get the layers: ``model(ids,
attention_mask=..., output_hidden_states=True)`` and a concatenation of the wanted layers. It runs
every layer and the LM head and keeps every layer's output; the capture stops after the last
captured layer and keeps only those. Both run on the same batches (random tokens, lengths spread
over each bucket's range, padded to its fixed shape, seeded), without a KV cache, after warmup;
each figure is the median over the timed repetitions, in real (unpadded) tokens per second. On a
GPU it also reports each path's peak memory (weights included).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from common.config import Config
from target_worker.hf_backend import HFTargetBackend, PaddedBatch, default_device, pad_job


class _RandomSamples:
    def __init__(self, lengths: list[int], vocab_size: int, seed: int):
        rng = np.random.default_rng(seed)
        self._samples = [(rng.integers(1, vocab_size, size=n), np.ones(n, dtype=np.uint8)) for n in lengths]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self._samples[index]


def _bucket_jobs(config: Config, vocab_size: int, seed: int) -> tuple[_RandomSamples, list[dict[str, Any]]]:
    """One full batch per bucket, lengths drawn uniformly from the bucket's range."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    jobs = []
    lower = 0
    for bucket, max_len in enumerate(config.schedule.buckets):
        rows = config.schedule.tokens_per_batch // max_len
        batch_lengths = rng.integers(lower + 1, max_len + 1, size=rows).tolist()
        samples = list(range(len(lengths), len(lengths) + rows))
        lengths += batch_lengths
        jobs.append({"job_id": bucket, "bucket": bucket, "seq_len": max_len, "samples": samples,
                     "lengths": batch_lengths, "num_tokens": sum(batch_lengths), "generation": 1})
        lower = max_len
    return _RandomSamples(lengths, vocab_size, seed), jobs


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


def bench_target(config: Config, *, warmup: int = 2, reps: int = 5, seed: int = 0) -> dict[str, Any]:
    if warmup < 0 or reps <= 0:
        raise ValueError(f"--warmup must be >= 0 and --reps positive, got {warmup} and {reps}")
    device = default_device(config)
    vocab_size = _vocab_size(config)
    dataset, jobs = _bucket_jobs(config, vocab_size, seed)
    backend = HFTargetBackend(config, device=device, dataset=dataset, keep_full_model=True)
    layer_ids = list(backend.contract["layer_ids"])
    model = backend.model

    def plain(batch: PaddedBatch) -> torch.Tensor:
        with torch.inference_mode():
            out = model(batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                        output_hidden_states=True, use_cache=False)
            return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)

    buckets: dict[str, dict[str, Any]] = {}
    for job in jobs:
        batch = pad_job(job, dataset, tokens_per_batch=config.schedule.tokens_per_batch)
        runs = {"capture": lambda: backend.forward(batch), "plain": lambda: plain(batch)}
        for _ in range(warmup):
            for fn in runs.values():
                _timed(fn, device)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(reps):  # interleaved, so drift in clock or cache state hits both alike
            for name, fn in runs.items():
                times[name].append(_timed(fn, device))
        tokens = job["num_tokens"]
        capture_s, plain_s = statistics.median(times["capture"]), statistics.median(times["plain"])
        row = {"batch": list(batch.input_ids.shape), "tokens": tokens, "capture_tok_s": tokens / capture_s,
               "plain_tok_s": tokens / plain_s, "speedup": plain_s / capture_s}
        if device.type == "cuda":  # the other half of the gain: no layer outputs or logits kept alive
            row.update({f"{name}_peak_gb": _peak_bytes(fn, device) / 1e9 for name, fn in runs.items()})
        buckets[str(job["seq_len"])] = row
    backend.close()
    return {"device": str(device), "dtype": backend.contract["dtype"], "contract": backend.contract,
            "warmup": warmup, "reps": reps, "buckets": buckets,
            "capture_not_slower": all(b["capture_tok_s"] >= b["plain_tok_s"] for b in buckets.values())}


def _vocab_size(config: Config) -> int:
    from common.capture_contract import read_model_config
    doc = read_model_config(config.target.model)
    text = doc.get("text_config", doc) if "vocab_size" not in doc else doc
    return int(text.get("vocab_size", 1000))


def format_target_bench(result: dict[str, Any]) -> str:
    contract = result["contract"]
    lines = [f"target {contract['architecture']}  {contract['num_layers']} layers × {contract['hidden_size']} hidden  "
             f"capture {contract['layer_ids']}  {result['dtype']} on {result['device']}  "
             f"(median of {result['reps']} after {result['warmup']} warmup)",
             f"{'bucket':>7}  {'batch':>10}  {'capture tok/s':>14}  {'plain tok/s':>12}  {'speedup':>7}"]
    for seq_len, row in result["buckets"].items():
        shape = "×".join(str(n) for n in row["batch"])
        memory = (f"  peak {row['capture_peak_gb']:.1f} vs {row['plain_peak_gb']:.1f} GB"
                  if "capture_peak_gb" in row else "")
        lines.append(f"{seq_len:>7}  {shape:>10}  {row['capture_tok_s']:>14,.0f}  {row['plain_tok_s']:>12,.0f}  "
                     f"{row['speedup']:>6.2f}x{memory}")
    verdict = "yes" if result["capture_not_slower"] else "NO"
    lines.append(f"capture at least as fast as the plain forward at every bucket: {verdict}")
    return "\n".join(lines)


def run_target_bench(config: Config, *, as_json: bool, warmup: int, reps: int) -> int:
    result = bench_target(config, warmup=warmup, reps=reps)
    print(json.dumps(result, indent=2) if as_json else format_target_bench(result))
    return 0
