"""The figures of one ``hsd bench pipeline`` run, read back from its journal (pure, no processes).

The measurement window opens when the last worker has registered and closes at the last commit:
process start-up (interpreters importing their libraries) is not a property of the dispatcher,
while filling the pool, the epoch tail and draining the pool are, so they stay inside.

Busy time per worker: a target's ``ready`` event carries the seconds it spent on the job (ending at
the event); a drafter's ``commit`` carries the seconds its micro-batches took, spread over the
step's jobs, each starting when the drafter reported it ``consumed`` (copied out). A stage's
capacity is its tokens per busy second over the whole run times its number of workers, as in
``hsd report``. Efficiency is the tokens/s that went through the slower stage inside the window,
divided by that stage's capacity. Measured at the slower stage because every job it starts inside
the window is trained by the window's end, while counting the drafters' output would credit the
window with targets' work done before it opened (targets that registered first fill the pool).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from common.run.records.events import DispatcherStopped, Event, JobConsumed, JobReady, StepCommitted, WorkerJoined
from common.run.records.job_ids import split_job_id

STAGES = ("target", "drafter")


@dataclass(frozen=True)
class Interval:
    worker: str
    start: float
    end: float
    tokens: int


def _overlap(interval: Interval, lo: float, hi: float) -> float:
    return max(0.0, min(interval.end, hi) - max(interval.start, lo))


def busy_intervals(events: list[Event]) -> dict[str, list[Interval]]:
    """Per stage, what each worker was busy with and when (see the module docstring). A worker
    does one job at a time, so its intervals never overlap: a target's is cut to start after its
    previous one ended (its end, the ``ready`` event, is exact), and a drafter's — whose start is
    only estimated, each job taking the step's average — starts once its previous one ended.
    Overlapping estimates would count a worker busy twice over and a stage more than busy."""
    consumed = {e.job: (e.t, e.w) for e in events if isinstance(e, JobConsumed)}
    out: dict[str, list[Interval]] = {"target": [], "drafter": []}
    for e in events:
        if isinstance(e, JobReady):
            out["target"].append(Interval(e.w, e.t - e.busy_s, e.t, e.tokens))
        elif isinstance(e, StepCommitted) and e.jobs:
            share_s, share_tokens = e.busy_s / len(e.jobs), e.tokens / len(e.jobs)
            for job in e.jobs:  # the rank that read it (a group's rank 0 commits every rank's jobs)
                start, worker = consumed.get(job, (e.t - share_s, e.w))
                out["drafter"].append(Interval(worker or e.w, start, start + share_s, share_tokens))
    return {"target": _one_at_a_time(out["target"], keep="end"), "drafter": _one_at_a_time(out["drafter"], keep="length")}


def _one_at_a_time(intervals: list[Interval], *, keep: str) -> list[Interval]:
    """Each worker's intervals without overlaps: ``keep="end"`` shortens one that starts before the
    previous ended, ``keep="length"`` moves it to start there."""
    by_worker: dict[str, list[Interval]] = defaultdict(list)
    for interval in intervals:
        by_worker[interval.worker].append(interval)
    out = []
    for mine in by_worker.values():
        free_at = float("-inf")
        for i in sorted(mine, key=lambda i: (i.start, i.end)):
            if i.start < free_at:
                i = (Interval(i.worker, min(free_at, i.end), i.end, i.tokens) if keep == "end"
                     else Interval(i.worker, free_at, free_at + (i.end - i.start), i.tokens))
            out.append(i)
            free_at = max(free_at, i.end)
    return out


def measurement_window(events: list[Event]) -> tuple[float, float]:
    first_join: dict[str, float] = {}
    for e in events:
        if isinstance(e, WorkerJoined):
            first_join.setdefault(e.w, e.t)
    commits = [e.t for e in events if isinstance(e, StepCommitted)]
    if not first_join or not commits:
        raise ValueError("the journal holds no worker or no commit: the run did not train")
    return max(first_join.values()), max(commits)


def utilization_timeline(intervals: Iterable[Interval], num_workers: int, lo: float, hi: float,
                         bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times relative to ``lo``, share of the stage's worker-seconds busy in each bin)."""
    edges = np.arange(lo, hi + bin_s, bin_s)
    busy = np.zeros(max(len(edges) - 1, 1))
    for interval in intervals:
        first = max(0, int((interval.start - lo) // bin_s))
        last = min(len(busy) - 1, int((interval.end - lo) // bin_s))
        for b in range(first, last + 1):
            busy[b] += _overlap(interval, lo + b * bin_s, lo + (b + 1) * bin_s)
    return edges[:len(busy)] - lo, busy / (bin_s * max(num_workers, 1))


def consumed_mix(events: list[Event], num_buckets: int, num_windows: int) -> np.ndarray:
    """[windows, buckets]: the bucket shares of the consumed stream in consecutive equal windows."""
    stream = [e.bucket for e in events if isinstance(e, JobConsumed)]
    if not stream:
        return np.zeros((0, num_buckets))
    windows = np.array_split(np.asarray(stream), min(num_windows, len(stream)))
    return np.stack([np.bincount(w, minlength=num_buckets)[:num_buckets] / len(w) for w in windows])


def pipeline_figures(events: list[Event], report: dict[str, Any], *, num_targets: int, num_drafters: int) -> dict:
    lo, hi = measurement_window(events)
    window_s = max(hi - lo, 1e-9)
    intervals = busy_intervals(events)
    workers = {"target": num_targets, "drafter": num_drafters}
    capacity, busy_in_window, tokens_in_window = {}, {}, {}
    for stage in STAGES:
        stage_intervals = intervals[stage]
        busy_in_window[stage] = sum(_overlap(i, lo, hi) for i in stage_intervals)
        tokens_in_window[stage] = sum(i.tokens * _overlap(i, lo, hi) / (i.end - i.start)
                                      for i in stage_intervals if i.end > i.start)
        # Tokens per busy second inside the window, on the mix the window holds: a worker's first
        # jobs pay its warm-up, which over a short run would make the whole run's rate understate
        # what the stage does once running (and the efficiency read above 1).
        busy, tokens = busy_in_window[stage], tokens_in_window[stage]
        if not busy:
            busy, tokens = sum(i.end - i.start for i in stage_intervals), sum(i.tokens for i in stage_intervals)
        capacity[stage] = workers[stage] * tokens / busy if busy else 0.0
    slower = min(STAGES, key=lambda s: capacity[s] or float("inf"))
    achieved = tokens_in_window[slower] / window_s
    # Where the targets' idle time went: the epoch tail (a target out of work while another still
    # extracts), the drain (no extraction left, drafters train what the pool holds), and the rest
    # (gaps between jobs: control-plane round trips, a full pool).
    last_by_target: dict[str, float] = {}
    for i in intervals["target"]:
        last_by_target[i.worker] = max(last_by_target.get(i.worker, lo), i.end)
    last_end = max(last_by_target.values(), default=lo)
    tail_idle = sum(last_end - t for t in last_by_target.values()) / (num_targets * window_s)
    drain_idle = (hi - last_end) / window_s
    stop = next((e for e in reversed(events) if isinstance(e, DispatcherStopped)), DispatcherStopped())
    last_ready = max((e.t for e in events if isinstance(e, JobReady)), default=lo)
    first_consumed = min((e.t for e in events if isinstance(e, JobConsumed)), default=lo)
    return {
        "efficiency": round(achieved / capacity[slower], 4) if capacity[slower] else 0.0,
        "drafter_wait": round(1 - busy_in_window["drafter"] / (num_drafters * window_s), 4),
        "target_idle": round(1 - busy_in_window["target"] / (num_targets * window_s), 4),
        "prefix_deviation": report["prefix_deviation"]["consumed"],
        "tail_skew": report["tail_skew"]["consumed"],
        "step_mix": report["step_mix"],
        "buckets_per_step": report["mean_buckets_per_step"],
        "peak_pool_bytes": int(stop.peak_slots * stop.slot_bytes),
        # what explains the figures above
        "slower_stage": slower,
        "achieved_tokens_per_s": round(achieved, 1),
        "trained_tokens_per_s": round(tokens_in_window["drafter"] / window_s, 1),
        "capacity_tokens_per_s": {s: round(capacity[s], 1) for s in STAGES},
        "window_s": round(window_s, 3),
        "fill_s": round(max(0.0, first_consumed - lo), 3),  # window open to the first job a drafter took
        "drain_s": round(max(0.0, hi - last_ready), 3),    # last extraction to the last commit
        "target_idle_breakdown": {"epoch_tail": round(tail_idle, 4), "drain": round(drain_idle, 4),
                                  "gaps": round(1 - busy_in_window["target"] / (num_targets * window_s)
                                                - tail_idle - drain_idle, 4)},
        "schedule_tail_skew": report["tail_skew"]["schedule"],
        "schedule_prefix_deviation": report["prefix_deviation"]["schedule"],
        "wall_efficiency": report["pipeline_efficiency"],  # hsd report's figure: start-up included
        "jobs": report["jobs_total"], "steps": report["steps"],
        "exactly_once": report["witness_duplicates"] == 0 and report["witness_missing"] == 0
                        and report["duplicates"] == 0 and report["lost"] == 0 and report["finished"],
    }


def target_queues(events: list[Event]) -> dict[str, Any]:
    """Per-target assignment as the journal shows it: each target's queue and the job indices it extracted."""
    queue = {e.w: e.queue for e in events if isinstance(e, WorkerJoined) and e.role == "target"}
    extracted: dict[str, list[int]] = defaultdict(list)
    for e in events:
        if isinstance(e, JobReady):
            extracted[e.w].append(split_job_id(e.job)[1])
    return {"queue": queue, "extracted": dict(extracted)}
