"""Sample lengths the schedule is built from: a lengths file, a prepared dataset, or a synthetic mix.

A prepared dataset is validated as a whole before its lengths are used (:func:`validate_prepared`):
a dataset whose files disagree is refused here, before any worker starts, rather than trained on
in part or found out by a target mid-run.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from common.run.config import DataSection, RunSection, ScheduleSection
from common.run.prepared import DataError, validate_prepared

# Sample shares per bucket of the synthetic default, shortest bucket first: the length mix measured on
# a real chat-distillation set, dominated by long responses.
SYNTHETIC_SHARES = (0.04, 0.07, 0.10, 0.15, 0.17, 0.47)
LENGTHS_FILE_IN_DATASET = "lengths.txt"
NAMED_TOO_LONG = 5  # samples too long for the schedule named by index in the log, hsd stats and hsd report


class DatasetError(DataError):
    pass


def read_lengths_file(path: str | Path) -> list[int]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"lengths file {path} does not exist")
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            value = int(text)
        except ValueError:
            raise DatasetError(f"{path}:{number}: expected a sequence length, got {text!r}") from None
        if value <= 0:
            raise DatasetError(f"{path}:{number}: sequence length must be positive, got {value}")
        lengths.append(value)
    if not lengths:
        raise DatasetError(f"lengths file {path} holds no lengths")
    return lengths


def synthetic_lengths(num_samples: int, bucket_max_lens: list[int], seed: int = 0) -> list[int]:
    """Lengths spread over the buckets with SYNTHETIC_SHARES (the last share repeats past six buckets)."""
    rng = random.Random(seed)
    shares = list(SYNTHETIC_SHARES[:len(bucket_max_lens)])
    shares += [SYNTHETIC_SHARES[-1]] * (len(bucket_max_lens) - len(shares))
    total = sum(shares)
    lengths = []
    lower = 0
    for max_len, share in zip(bucket_max_lens, shares):
        count = round(num_samples * share / total)
        lengths += [rng.randint(lower + 1, max_len) for _ in range(count)]
        lower = max_len
    rng.shuffle(lengths)
    return lengths


def load_lengths(data: DataSection, schedule: ScheduleSection, run: RunSection) -> list[int]:
    """The samples' lengths: ``data.lengths``'s, the prepared dataset's at ``data.path`` (validated
    whole first: raises DataError naming the file and the first bad sample), or the synthetic
    distribution over ``schedule.buckets`` drawn from ``run.seed``."""
    if data.lengths:
        return read_lengths_file(data.lengths)
    if data.path:
        return validate_prepared(data.path).lengths.tolist()
    return synthetic_lengths(data.synthetic_samples, schedule.buckets, seed=run.seed)


def too_long_samples(lengths: list[int] | np.ndarray, bucket_max_lens: list[int]) -> np.ndarray:
    """Indices of the samples longer than the last bucket: the schedule has no place for them."""
    return np.flatnonzero(np.asarray(lengths, dtype=np.int64) > bucket_max_lens[-1])


def too_long_line(indices: np.ndarray, lengths: list[int] | np.ndarray, last_bucket: int) -> str:
    """The log line naming the samples no epoch trains: how many, the first few, and what to do."""
    named = ", ".join(f"{i} ({lengths[i]} tokens)" for i in indices[:NAMED_TOO_LONG].tolist())
    more = f" and {len(indices) - NAMED_TOO_LONG} more" if len(indices) > NAMED_TOO_LONG else ""
    return (f"{len(indices)} of {len(lengths)} samples are longer than the last bucket ({last_bucket}) and no epoch "
            f"trains them: sample {named}{more}; raise schedule.buckets' last, or prepare with --max-length "
            f"{last_bucket} to leave them out")
