"""The shm path's per-item timeline in ``hsd bench transport``: where each slot's time goes.

The target and the drafter stamp every item with ``time.perf_counter_ns`` (CLOCK_MONOTONIC on
Linux: one clock for every process of a host) at each step of its handoff:

- the target: ``target_granted`` (its get_job answered), ``write_start``/``write_end`` (the copy
  into the slot), ``published`` (the header with its generation stored), ``reported`` (job_ready sent);
- the drafter: ``granted`` (its get_hs answered with the item), ``read_start``/``read_end`` (the
  copy out of the slot), ``consumed`` (its report sent, or carried by the next get_hs).

:func:`summarize` reduces the items the drafter read inside its measured window to medians of
each stamp's offset from the item's ``write_start`` (``target_granted`` comes before it: negative,
and below minus the previous write's length when the grant came before that write ended), the
medians of each side's copy and of the idle gap between two of its copies, each process's CPU time
per item, and ``overlap``: the fraction of the drafter's copying time during which the target was
copying too. Two copies that take turns read an overlap near 0 and each side idle about as long as
the other copies; two that overlap read near 1.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

TARGET_EVENTS = ("target_granted", "write_start", "write_end", "published", "reported")
DRAFTER_EVENTS = ("granted", "read_start", "read_end", "consumed")
OFFSET_EVENTS = ("target_granted", "write_end", "published", "reported", "granted", "read_start", "read_end",
                 "consumed")


class Stamps:
    """Per job id, the time (ns) of each event of its handoff, as one process saw it."""

    def __init__(self) -> None:
        self.by_job: dict[int, dict[str, int]] = {}

    def mark(self, job_id: int, event: str, *, cpu: bool = False) -> None:
        """``cpu``: also stamp the process's CPU time (every thread's) as ``cpu``."""
        events = self.by_job.setdefault(job_id, {})
        events[event] = time.perf_counter_ns()
        if cpu:
            events["cpu"] = time.process_time_ns()

    def export(self) -> dict[str, dict[str, int]]:
        """JSON-ready: job ids as strings."""
        return {str(job_id): events for job_id, events in self.by_job.items()}


def _merge(*intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(i for group in intervals for i in group):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    total = i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _gaps_ms(intervals: list[tuple[int, int]]) -> list[float]:
    return [(later[0] - earlier[1]) / 1e6 for earlier, later in zip(intervals, intervals[1:])]


def summarize(target: dict[str, dict[str, int]], drafter: dict[str, dict[str, int]], *,
              since_ns: int = 0) -> dict[str, Any]:
    """The timeline's figures over the items the drafter started reading at or after ``since_ns``."""
    items = [{**target[job], **drafter[job], "target_cpu": target[job].get("cpu", 0),
              "drafter_cpu": drafter[job].get("cpu", 0)}
             for job in drafter if job in target
             and drafter[job].get("read_start", -1) >= since_ns
             and all(e in target[job] for e in TARGET_EVENTS) and all(e in drafter[job] for e in DRAFTER_EVENTS)]
    if len(items) < 2:
        return {"items": len(items)}
    first, last = min(i["read_start"] for i in items), max(i["read_end"] for i in items)
    # Every write the target did while these items were read, whether or not its item was read in the window.
    writes = _merge([(t["write_start"], t["write_end"]) for t in target.values() if "write_end" in t
                     and t["write_end"] >= first and t["write_start"] <= last])
    reads = sorted((i["read_start"], i["read_end"]) for i in items)
    read_ns = sum(end - start for start, end in reads)
    median = statistics.median
    in_order = sorted(items, key=lambda i: i["read_start"])

    def cpu_ms(key: str) -> float:
        """A process's CPU time per item, its copy and its control work (every thread) together."""
        return round((in_order[-1][key] - in_order[0][key]) / (len(in_order) - 1) / 1e6, 3)
    pairs = list(zip(in_order, in_order[1:]))
    mean_ms = lambda values: round(statistics.fmean(values) / 1e6, 3)  # noqa: E731
    return {
        "items": len(items),
        "offsets_ms": {e: round(median((i[e] - i["write_start"]) / 1e6 for i in items), 3) for e in OFFSET_EVENTS},
        "write_ms": round(median((i["write_end"] - i["write_start"]) / 1e6 for i in items), 3),
        "read_ms": round(median((i["read_end"] - i["read_start"]) / 1e6 for i in items), 3),
        "target_idle_ms": round(median(_gaps_ms(writes)), 3) if len(writes) > 1 else None,
        "drafter_idle_ms": round(median(_gaps_ms(reads)), 3),
        "target_cpu_ms": cpu_ms("target_cpu"),
        "drafter_cpu_ms": cpu_ms("drafter_cpu"),
        "overlap": round(_intersection_ns(writes, _merge(reads)) / read_ns, 3) if read_ns else None,
        # Means, which set the throughput (medians hide the slow tail): the drafter's time per item
        # (one read start to the next), its idle gaps between reads, and the part of each gap spent
        # before the next item was published (waiting for the target; the rest is the handoff:
        # report, grant, and the loop's own work between two reads)
        "cycle_ms": mean_ms([b["read_start"] - a["read_start"] for a, b in pairs]),
        "drafter_idle_mean_ms": mean_ms([b["read_start"] - a["read_end"] for a, b in pairs]),
        "idle_waiting_for_write_ms": mean_ms([min(b["read_start"] - a["read_end"], max(0, b["published"] - a["read_end"]))
                                              for a, b in pairs]),
    }


def cpus_busy(summary: dict[str, Any], dispatcher_cpu_ms: float, cpu_count: int) -> float | None:
    """The share of the host's CPUs the target, the drafter and the dispatcher kept busy per item
    (copies and control together): near 1, the control plane's CPU is taken from the copies."""
    if "cycle_ms" not in summary or not summary["cycle_ms"]:
        return None
    used = summary["target_cpu_ms"] + summary["drafter_cpu_ms"] + dispatcher_cpu_ms
    return round(used / (summary["cycle_ms"] * cpu_count), 3)


def describe(summary: dict[str, Any]) -> str:
    """One line: the medians of the item's stamps from its write's start, and the overlap."""
    if "offsets_ms" not in summary:
        return f"timeline: {summary['items']} item(s), too few to summarize"
    offsets = " ".join(f"{event} {ms:+.2f}" for event, ms in summary["offsets_ms"].items())
    return (f"timeline (ms from write_start, medians of {summary['items']} items): {offsets}; "
            f"write {summary['write_ms']:.2f}, read {summary['read_ms']:.2f}, idle between copies: target "
            f"{summary['target_idle_ms'] or 0:.2f}, drafter {summary['drafter_idle_ms']:.2f}; reads overlapping a "
            f"write {summary['overlap']:.0%}; CPU per item: target {summary['target_cpu_ms']:.2f}, drafter "
            f"{summary['drafter_cpu_ms']:.2f}; means per item: cycle {summary['cycle_ms']:.2f}, drafter idle "
            f"{summary['drafter_idle_mean_ms']:.2f} ({summary['idle_waiting_for_write_ms']:.2f} of it before the item "
            f"was published)" + (f"; the CPUs {summary['cpus_busy']:.0%} busy (copies and control together)"
                                 if summary.get("cpus_busy") is not None else ""))
