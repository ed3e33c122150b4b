"""What a worker holds, as typed messages (:mod:`common.wire.messages`), for tests that hand a job
or a registration to a backend or a worker's helper directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.wire import messages


def held_job(job_id: int = 0, *, samples: Sequence[int] = (0,), lengths: Sequence[int] = (16,), seq_len: int = 16,
             bucket: int = 0, slot: int = 0, generation: int = 1, num_tokens: int | None = None) -> messages.Job:
    """A granted job; ``num_tokens`` is the lengths' sum unless given."""
    return messages.Job(job_id=job_id, epoch=0, bucket=bucket, seq_len=seq_len, samples=list(samples),
                        lengths=list(lengths), num_tokens=sum(lengths) if num_tokens is None else num_tokens,
                        slot=slot, generation=generation)


def registration(**fields: Any) -> messages.RegisterReply:
    """A register reply of a one-epoch shm run, ``fields`` overriding."""
    reply: dict[str, Any] = {"worker_id": "d0", "token": "t", "run_id": "test", "transport": {"kind": "shm"},
                             "heartbeat_s": 1.0, "worker_timeout_s": 5.0, "accum_steps": 1, "buckets": [16],
                             "epochs": 1, **fields}
    return messages.RegisterReply(**reply)
