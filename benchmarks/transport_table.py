"""The table ``hsd bench transport`` prints, and the targets it judges the figures by."""

from __future__ import annotations

from typing import Any

from benchmarks.transport_timeline import describe as describe_timeline
from common.dataplane.slots import format_bytes

TARGETS = {"shm_vs_memcpy": 0.8, "shm_vs_torch_mp_queue": 3.0}
RTT_P99_TARGET_MS = 1.5

# (label, a str.format of the figures; the figure's key): a row for each figure the run measured
_TABLE_ROWS = (
    ("memcpy, one process", "memcpy_gbps"),
    ("memcpy over {memcpy_uncached_buffers} buffers", "memcpy_uncached_gbps"),
    ("memcpy beside another copy", "memcpy_shared_gbps"),
    ("shm arena, real protocol", "shm_gbps"),
    ("  its drafter's copy alone", "shm_copy_gbps"),
    ("shm arena, piped, no dispatcher", "shm_piped_gbps"),
    ("torch.multiprocessing Queue", "torch_mp_queue_gbps"),
    ("  tensors allocated in shm", "torch_mp_queue_shared_gbps"),
    ("zmq PUSH/PULL ipc://", "zmq_ipc_gbps"),
    ("cuda d2d, one GPU", "d2d_gbps"),
    ("cuda_ipc {cuda_ipc_devices}", "cuda_ipc_gbps"),
)


def format_table(figures: dict[str, Any]) -> str:
    memcpy, met = figures["memcpy_gbps"], figures["targets_met"]

    def verdict(key: str) -> str:
        return "ok" if met[key] else "MISSED"

    lines = [f"slot {format_bytes(figures['slot_bytes'])} ({figures['slot_bytes']} bytes), "
             f"{figures['seconds']:g} s per path, {figures['num_cpus']} CPUs", "",
             f"{'path':<32} {'GB/s':>7} {'vs memcpy':>10}"]
    for label, key in _TABLE_ROWS:
        if key in figures:
            lines.append(f"{label.format(**figures):<32} {figures[key]:>7.2f} {figures[key] / memcpy:>10.2f}")
    f = figures
    lines += [
        "",
        f"shm / memcpy            {f['shm_vs_memcpy']:5.2f}  target >= {TARGETS['shm_vs_memcpy']:g}: "
        f"{verdict('shm_vs_memcpy')}  (vs memcpy over {f['memcpy_uncached_buffers']} buffers: {f['shm_vs_memcpy_uncached']:.2f})",
        f"memcpy shared / memcpy  {f['memcpy_shared_vs_memcpy']:5.2f}  the ceiling this host's memory bus puts on "
        f"shm / memcpy: two copies at once",
        f"shm / memcpy shared     {f['shm_vs_memcpy_shared']:5.2f}  what the shm path keeps of that ceiling"
        + (f" (medians of {len(f['rounds'])} alternated rounds; shm / memcpy by round: "
           f"{', '.join(format(r['shm_vs_memcpy'], '.2f') for r in f['rounds'])})" if len(f["rounds"]) > 1 else ""),
        f"shm / shm piped         {f['shm_vs_shm_piped']:5.2f}  what the control plane keeps of this host's "
        f"data plane (shm piped / memcpy: {f['shm_piped_vs_memcpy']:.2f})",
        f"shm / torch mp Queue    {f['shm_vs_torch_mp_queue']:5.2f}  target >= {TARGETS['shm_vs_torch_mp_queue']:g}: "
        f"{verdict('shm_vs_torch_mp_queue')}  (vs its best case: {f['shm_vs_torch_mp_queue_shared']:.2f})",
        f"shm {describe_timeline(f['shm_timeline'])}",
        f"shm drafter             {f['shm_control_ms']:.2f} ms per item in get_hs/consumed/commit_step; "
        f"the dispatcher's CPU {f['shm_dispatcher_cpu_ms']:.2f} ms per item",
        f"get_hs with consumed    p50 {f['rtt_p50_ms']:.3f} ms  p99 {f['rtt_p99_ms']:.3f} ms  "
        f"target p99 <= {RTT_P99_TARGET_MS:g} ms: {verdict('rtt_p99_ms')}",
        f"  against a bare echo   p50 {f['rtt_floor_p50_ms']:.3f} ms  p99 {f['rtt_floor_p99_ms']:.3f} ms  "
        f"(one round trip between two processes on this host, no dispatcher)",
        f"commit_step (fsync)     p50 {f['commit_rtt_p50_ms']:.3f} ms  p99 {f['commit_rtt_p99_ms']:.3f} ms  "
        f"({f['rtt_commits']} commits, one every {f['rtt_accum_steps']} cycles; {f['rtt_cycles']} cycles timed, "
        f"{f['rtt_waited']} left out: no slot was ready)",
        f"  the dispatcher's CPU  {f['rtt_dispatcher_cpu_us']:.0f} us per cycle (its get_hs, the target's "
        f"job_ready and get_job, a share of a commit)",
        f"host                    other processes used {f['other_cpu_pct']:.1f}% of the CPUs, "
        f"steal {f['steal_pct']:.1f}%",
    ]
    return "\n".join(lines)
