"""The table ``hsd bench scale`` prints, one row per sweep step (:mod:`benchmarks.scale`)."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.scale_model import GpuModel

COLUMNS = (("workers", 12), ("items/s", 14), ("disp CPU", 9), ("us/item", 13), ("request ms", 20),
           ("hb lag", 8), ("journal", 9), ("GPUs/core", 10), ("client CPU", 12), ("host", 13))


def table_header(model: GpuModel) -> str:
    head = "".join(name.rjust(width) for name, width in COLUMNS)
    return (f"GPU model: a target GPU {model.tokens_per_s:,.0f} tokens/s in jobs of {model.job_tokens:,} tokens "
            f"({model.target_jobs_per_s:.2f} items/s), a drafter {model.drafter_batches_per_s:g} micro-batches/s\n"
            f"columns: workers T+D (xL: each at L times the model's rates); items/s done (offered); the dispatcher's CPU (% of a core); its CPU per item, "
            f"all threads (loop thread); request p50/p99/max; heartbeat lag p99 ms; journal KB/s; target GPUs "
            f"one dispatcher core serves; each client process's CPU %; other use / steal % of the host\n{head}")


def _num(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def format_step(s: dict[str, Any]) -> str:
    cells = (
        f"{s['targets']}+{s['drafters']}" + (f"x{s['load']:g}" if s.get("load", 1) != 1 else ""),
        f"{_num(s['items_per_s'], '.0f')} ({_num(s['offered_items_per_s'], '.0f')})",
        f"{_num(s['dispatcher_cpu_pct'], '.0f')}%",
        f"{_num(s['dispatcher_cpu_us_per_item'], '.0f')} ({_num(s['loop_thread_cpu_us_per_item'], '.0f')})",
        f"{_num(s['request_p50_ms'], '.1f')}/{_num(s['request_p99_ms'], '.1f')}/{_num(s['request_max_ms'], '.0f')}",
        _num(s["heartbeat_lag_p99_ms"], ".1f"),
        _num(s["journal_bytes_per_s"] / 1e3, ".0f"),
        _num(s["projected_gpus_per_core"], ".0f"),
        "/".join(_num(p, ".0f") for p in s["client_cpu_pct"]) + ("!" if s["client_saturated"] else ""),
        f"{_num(s['other_cpu_pct'], '.0f')}/{_num(s['steal_pct'], '.1f')}",
    )
    row = "".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS))
    notes = []
    if s.get("load", 1) != 1:
        notes.append(f"the traffic of {s['gpus_served']:,.0f} target GPUs of the stated model "
                     f"({s['targets']} connections at {s['load']:g}x its rates)")
    by_thread = s.get("thread_cpu_us_per_item") or {}
    if by_thread:
        notes.append("us/item by thread: " + ", ".join(
            f"{name} {us:.0f}" for name, us in sorted(by_thread.items(), key=lambda kv: -kv[1]) if us >= 1))
    by_what = s.get("loop_cpu_us_per_item") or {}
    if by_what:
        notes.append("loop us/item by op or phase: " + ", ".join(
            f"{what} {us:.0f}" for what, us in by_what.items() if us >= 1))
    per_request = s.get("loop_cpu_us_per_request") or {}
    if per_request:
        notes.append("loop us/request: " + ", ".join(f"{op} {us:.0f}" for op, us in sorted(per_request.items())))
    wakeups = s.get("loop_wakeups_per_item")
    if wakeups is not None and not math.isnan(wakeups):  # the loop woke in the window
        notes.append(f"loop wake-ups/item {wakeups:.2f}, {s['loop_cpu_us_per_wakeup']:.0f} us of "
                     f"the loop's CPU a wake-up")
    if s.get("floor_cpu_us_per_request") is not None:
        notes.append(
            f"socket floor (a bare echo, {s['floor_connections']} connections at {s['floor_requests_per_s']:,.0f} "
            f"requests/s): {_num(s['floor_cpu_us_per_request'], '.0f')} us a request (loop "
            f"{_num(s['floor_loop_us_per_request'], '.0f')}, I/O {_num(s['floor_io_us_per_request'], '.0f')}), "
            f"{_num(s['floor_requests_per_wakeup'], '.2f')} requests a wake-up; x {s['requests_per_item']:.2f} "
            f"requests an item = {_num(s['floor_cpu_us_per_item'], '.0f')} us an item; the dispatcher "
            f"{_num(s['dispatcher_cpu_us_per_request'], '.0f')} us a request, {_num(s['over_floor'], '.1f')}x the floor")
    if s["duplicates"]:
        notes.append(f"EXACTLY-ONCE VIOLATED: {s['duplicates']} job(s) committed twice")
    if s["errors"]:
        notes.append(f"error replies {s['errors']}")
    if s["given_back"]:
        notes.append(f"given back {s['given_back']}")
    if s["client_saturated"]:
        notes.append("a client process is saturated (!): the workers may set the pace, not the dispatcher")
    return row + "".join(f"\n    {note}" for note in notes)
