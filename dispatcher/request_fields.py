"""What the fields of a request must be, beyond the required ones :mod:`common.wire.protocol` names:
checked once, as the request arrives, into the values the core takes; a bad field is a
``malformed`` error naming it (the dispatcher carries on)."""

from __future__ import annotations

import hmac
from typing import Any

from common.wire.protocol import ROLES, ErrorCode, ProtocolError, field_of

MAX_STEP_METRICS = 16  # commit_step's metrics: a few figures for hsd stats, never a payload


def step_metrics(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_STEP_METRICS
            or not all(isinstance(k, str) and len(k) <= 32 and isinstance(v, (int, float)) and not isinstance(v, bool)
                       for k, v in value.items())):
        raise ProtocolError(ErrorCode.MALFORMED, f"metrics must map at most {MAX_STEP_METRICS} short names to numbers")
    return {k: float(v) for k, v in value.items()}



def job_id_list(fields: dict) -> list[int]:
    job_ids = field_of(fields, "job_ids", list)
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in job_ids):
        raise ProtocolError(ErrorCode.MALFORMED, "job_ids must be a list of integers")
    return job_ids


def membership_of(fields: dict) -> int | None:
    value = fields.get("membership")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ProtocolError(ErrorCode.MALFORMED, "field 'membership' must be an integer")
    return value


def rank_costs(fields: dict) -> dict:
    """commit_step's optional per-rank figures of a group: {rank_jobs: [int], rank_busy_s: [float],
    cost_jobs?: [int]}."""
    jobs, busy = fields.get("rank_jobs"), fields.get("rank_busy_s")
    if jobs is None and busy is None:
        return {}
    if (not isinstance(jobs, list) or not isinstance(busy, list) or len(jobs) != len(busy)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in jobs)
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in busy)):
        raise ProtocolError(ErrorCode.MALFORMED, "rank_jobs and rank_busy_s must be lists of equal length of "
                                                 "counts and seconds")
    costs = {"rank_jobs": jobs, "rank_busy_s": [float(b) for b in busy]}
    cost_jobs = fields.get("cost_jobs")
    if cost_jobs is not None:
        if not isinstance(cost_jobs, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in cost_jobs):
            raise ProtocolError(ErrorCode.MALFORMED, "cost_jobs must be a list of job ids")
        costs["cost_jobs"] = cost_jobs
    return costs


def poll_fields(op: str, fields: dict) -> dict:
    """What a long-poll's op takes besides the worker: checked once, kept with a parked poll."""
    if op == "get_hs":
        return {"membership": membership_of(fields)}
    if op == "join_group":
        return {"after": field_of(fields, "after", int), "step": field_of(fields, "step", int),
                "failed": bool(fields.get("failed", False))}
    return {}


def same_secret(given: Any, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def register_fields(fields: dict) -> dict[str, Any]:
    """A register request's worker fields, as :meth:`dispatcher.core.DispatcherCore.register` takes them."""
    role = field_of(fields, "role", str)
    if role not in ROLES:
        raise ProtocolError(ErrorCode.MALFORMED, f"role must be one of {', '.join(ROLES)}")
    contract, model = fields.get("contract"), fields.get("model")
    if contract is not None and not isinstance(contract, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "contract must be a map")
    if model is not None and not isinstance(model, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "model must be a map {id, step}")
    return {"role": role, "name": field_of(fields, "name", str), "pid": field_of(fields, "pid", int),
            "host": field_of(fields, "host", str), "gpu": fields.get("gpu"), "contract": contract, "model": model,
            "node": field_of(fields, "node", str) if fields.get("node") is not None else None}
