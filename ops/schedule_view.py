"""``hsd schedule``: plan buckets for a dataset and see the fairness of its epoch order."""

from __future__ import annotations

import json

import numpy as np

from common.run.config import Config
from common.run.records.lengths import LENGTHS_FILE_IN_DATASET, load_lengths, read_lengths_file
from common.run.records.schedule import ORDERS, EpochSchedule, build_epoch_schedule, pairs_batched_again


def _lengths(config: Config, lengths_file: str | None, data_dir: str | None) -> list[int]:
    if lengths_file:
        return read_lengths_file(lengths_file)
    if data_dir:
        from pathlib import Path
        return read_lengths_file(Path(data_dir) / LENGTHS_FILE_IN_DATASET)
    return load_lengths(config.data, config.schedule, config.run)


def _build(config: Config, lengths: list[int], epoch: int, order: str) -> EpochSchedule:
    return build_epoch_schedule(lengths, bucket_max_lens=config.schedule.buckets,
                                tokens_per_batch=config.schedule.tokens_per_batch,
                                run_seed=config.run.seed, epoch=epoch, order=order,
                                batching=config.schedule.batching)


def print_schedule(config: Config, *, lengths_file: str | None, data_dir: str | None, epoch: int,
                   as_json: bool) -> int:
    lengths = _lengths(config, lengths_file, data_dir)
    if as_json:
        schedule = _build(config, lengths, epoch, config.schedule.order)
        following = _build(config, lengths, epoch + 1, config.schedule.order)
        print(json.dumps({**schedule.summary(),
                          "padded_fill": round(schedule.padded_fill(np.asarray(lengths, dtype=np.int64)), 4),
                          "pairs_batched_again": round(pairs_batched_again(schedule, following), 4)}))
        return 0
    schedules = {order: _build(config, lengths, epoch, order) for order in ORDERS}
    first = schedules[ORDERS[0]]
    num_jobs = len(first.batches)
    fill, bucket_fill = first.fill(np.asarray(lengths, dtype=np.int64))
    print(f"epoch {epoch}: {len(lengths)} samples, {first.num_dropped} dropped (longer than "
          f"{config.schedule.buckets[-1]}), {num_jobs} jobs of {config.schedule.tokens_per_batch} tokens, "
          f"batching {first.batching}: {fill:.1%} of slot tokens real")
    following = _build(config, lengths, epoch + 1, ORDERS[0])
    print(f"padded tokens {first.padded_fill(np.asarray(lengths, dtype=np.int64)):.1%} real; "
          f"{pairs_batched_again(first, following):.1%} of the sample pairs batched together are together "
          f"again in epoch {epoch + 1}")
    print(f"{'bucket':>6} {'max_len':>8} {'batch':>6} {'samples':>8} {'share':>7} {'batches':>8} {'job share':>9} "
          f"{'fill':>6}")
    total_samples = max(1, sum(b.num_samples for b in first.buckets))
    for b in first.buckets:
        print(f"{b.id:>6} {b.max_len:>8} {b.batch_size:>6} {b.num_samples:>8} {b.num_samples / total_samples:>7.1%} "
              f"{b.num_batches:>8} {b.num_batches / max(1, num_jobs):>9.1%} {bucket_fill.get(b.id, 0.0):>6.1%}")
    print()
    print(f"{'order':<11} {'prefix deviation':>17} {'tail skew':>10}   first 40 jobs (bucket ids)")
    for order, schedule in schedules.items():
        figures = schedule.figures()
        head = "".join(str(b) if b < 10 else "+" for b in schedule.bucket_order[:40])
        marker = " <- schedule.order" if order == config.schedule.order else ""
        print(f"{order:<11} {figures['prefix_deviation']:>17.2f} {figures['tail_skew']:>10.4f}   {head}{marker}")
    return 0
