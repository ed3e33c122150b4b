"""Job ids: an epoch and a position in that epoch's job list, in one integer that orders jobs in
schedule order across epochs (the journal, the ledger and the report all name jobs by it)."""

from __future__ import annotations

JOB_ID_STRIDE = 1_000_000_000  # job id = epoch * stride + position in the epoch's job list


def make_job_id(epoch: int, index: int) -> int:
    return epoch * JOB_ID_STRIDE + index


def split_job_id(job_id: int) -> tuple[int, int]:
    return divmod(job_id, JOB_ID_STRIDE)
