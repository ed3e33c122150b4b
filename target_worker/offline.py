"""``hsd capture``: a dataset's first samples captured to one safetensors file, without a run.

The samples go through exactly what a target worker does: they are grouped into jobs at their
bucket's fixed shape (in dataset order, each bucket's batch filled before it is emitted) and each
job is extracted by :class:`HFTargetBackend` into a slot, which is then read back; so the file holds
what a drafter would have received. Per sample ``i`` (real tokens only)::

    sample.{i}.hidden     [length, K × hidden]  capture dtype
    sample.{i}.input_ids  [length]              int32
    sample.{i}.loss_mask  [length]              uint8

The file's metadata holds the capture contract (JSON), the sample indices and the dataset's
fingerprint when it has one. Samples longer than the last bucket are skipped, as the schedule drops
them. The file is streamed to disk one batch at a time (memory stays at one slot, whatever N is)
and appears under its name only when complete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from common.run.config import Config
from common.dataplane.slots import SlotLayout, SlotView
from common.wire import messages
from target_worker.hf_backend import HFTargetBackend, SampleSource, default_device
from target_worker.safetensors_stream import StreamingSafetensorsWriter


def open_dataset(path: str | Path) -> SampleSource:
    """The prepared dataset at ``path`` (``hsd prepare``'s output)."""
    try:
        from common.run.prepared import PreparedDataset
    except ImportError:
        raise ValueError("reading a prepared dataset needs common/run/prepared.py, which this build lacks") from None
    return PreparedDataset(path)


def sample_lengths(dataset: SampleSource, num_samples: int) -> list[int]:
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        return [len(dataset.sample(i)[0]) for i in range(num_samples)]
    if len(lengths) < num_samples:
        raise ValueError(f"the dataset holds {len(lengths)} samples, fewer than the {num_samples} asked for")
    return [int(n) for n in lengths[:num_samples]]


def plan_jobs(lengths: list[int], *, buckets: list[int], tokens_per_batch: int) -> tuple[list[messages.Job], list[int]]:
    """Jobs (as a target is granted them) covering samples ``0..len(lengths)-1``, and the skipped (too long) ones."""
    pending: list[list[int]] = [[] for _ in buckets]
    jobs: list[messages.Job] = []
    skipped = []

    def emit(bucket: int) -> None:
        samples = pending[bucket]
        jobs.append(messages.Job(job_id=len(jobs), epoch=0, bucket=bucket, seq_len=buckets[bucket],
                                 samples=list(samples), lengths=[lengths[i] for i in samples],
                                 num_tokens=sum(lengths[i] for i in samples), slot=0, generation=len(jobs) + 1))
        samples.clear()

    for index, length in enumerate(lengths):
        bucket = next((b for b, max_len in enumerate(buckets) if length <= max_len), None)
        if bucket is None:
            skipped.append(index)
            continue
        pending[bucket].append(index)
        if len(pending[bucket]) == tokens_per_batch // buckets[bucket]:
            emit(bucket)
    for bucket in range(len(buckets)):
        if pending[bucket]:
            emit(bucket)
    return jobs, skipped


def capture_to_file(config: Config, dataset: SampleSource, *, num_samples: int, out: str | Path,
                    progress: bool = True) -> dict[str, Any]:
    """Capture samples ``0..num_samples-1`` into ``out``; returns a summary (samples, tokens, skipped)."""
    from tqdm import tqdm

    if num_samples <= 0:
        raise ValueError(f"--samples must be positive, got {num_samples}")
    lengths = sample_lengths(dataset, num_samples)
    jobs, skipped = plan_jobs(lengths, buckets=list(config.schedule.buckets),
                              tokens_per_batch=config.schedule.tokens_per_batch)
    dropped = set(skipped)
    captured = [i for i in range(num_samples) if i not in dropped]
    backend = HFTargetBackend(config.target, config.schedule, objective=config.drafter.objective,
                              device=default_device(config.target), dataset=dataset)
    layout = SlotLayout.from_contract(backend.contract, config.schedule)
    slot = SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8), layout)
    specs = []
    for i in captured:
        specs += [(f"sample.{i}.hidden", layout.torch_dtype, (lengths[i], layout.row_width)),
                  (f"sample.{i}.input_ids", torch.int32, (lengths[i],)),
                  (f"sample.{i}.loss_mask", torch.uint8, (lengths[i],))]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    metadata = {"contract": json.dumps(backend.contract.to_dict()), "samples": json.dumps(captured)}
    fingerprint = getattr(dataset, "fingerprint", None)
    if fingerprint is not None:  # which dataset version the states belong to
        metadata["dataset_fingerprint"] = str(fingerprint)
    try:
        with StreamingSafetensorsWriter(out, specs, metadata=metadata) as writer, \
                tqdm(total=len(captured), unit="sample", desc="capture", disable=not progress, file=sys.stderr) as bar:
            for job in jobs:
                backend.extract(job, slot)
                batch = slot.batch(slot.expect_generation(job.generation))
                for row, index in enumerate(job.samples):
                    length = int(batch.seq_lens[row])
                    writer.write(f"sample.{index}.hidden", batch.hs[row, :length])
                    writer.write(f"sample.{index}.input_ids", batch.input_ids[row, :length])
                    writer.write(f"sample.{index}.loss_mask", batch.loss_mask[row, :length])
                bar.update(len(job.samples))
    finally:
        backend.close()
    return {"samples": len(captured), "tokens": sum(lengths[i] for i in captured), "skipped": skipped,
            "jobs": len(jobs), "out": str(out), "contract": backend.contract.to_dict()}
