"""``hsd bench transport``: how fast hidden states move from a target to a drafter on this host.

Every path moves the same bytes per item, the hidden-state region of one slot (about
``--slot-mb`` MiB), from a producer's preallocated source into a consumer's preallocated
destination, and is measured for ``--seconds`` after a short warm-up (GB/s, 1 GB = 1e9 bytes):

- ``memcpy``: one process copying the bytes between two buffers: the limit of every path.
  ``memcpy_uncached`` is the same copy cycling through as much memory as the shm path does;
  ``memcpy_shared`` is one process's copy while a second process copies too: the shm path copies
  every byte twice, in two processes at once, so ``memcpy_shared_vs_memcpy`` is the ceiling this
  host's memory bus puts on ``shm_vs_memcpy``.
- ``memcpy``, ``memcpy_shared`` and ``shm`` are measured one after another in each of ``--rounds``
  rounds (default 1), so every ratio among them compares the same moments of the host; with several
  rounds each figure and ratio is the median of the rounds' own (every round under ``rounds``).
- ``shm``: the shared-memory arena through the real protocol: a dispatcher process, a target
  (get_job, write the slot, job_ready) and a drafter (get_hs, copy out, consumed, commit_step).
  The drafter reads with ``DrafterTransport.read`` and commits every ``drafter.accum_steps`` (4)
  items, as a drafter does; ``shm_copy`` is its copy alone and ``shm_control_ms`` its time in
  those calls per item; ``shm_dispatcher_cpu_ms`` the dispatcher's CPU time per item (on a host
  with few cores it is taken from the two copies), ``shm_dispatcher_loop_us_per_item`` its socket
  loop's by op or phase (its ``loop_cpu_s``, docs/stats.md) and ``shm_dispatcher_messages_per_item``
  the requests it answered, by op (both of the median round), ``shm_dispatcher_wakeups_per_item``
  its loop's wake-ups (the median of the rounds).
- ``shm_piped``: the same arena and the same copies, with a pipe between the two processes in place
  of the dispatcher: the data plane's ceiling on this host, so ``shm_vs_shm_piped`` is what the
  control plane keeps of it.
- ``torch_mp_queue``: a torch.multiprocessing Queue of fresh CPU tensors, put as a producer usually
  does (``_shared``: allocated in shared memory up front, the queue's best case).
- ``zmq_ipc``: ZeroMQ PUSH/PULL over ipc:// with zero-copy sends.
- ``rtt``: control-plane latency of a drafter's cycle against the dispatcher, one get_hs carrying
  the consumed report of the previous cycle's slot (as a lone drafter sends it), and of
  commit_step (journaled with fsync) separately, sent every ``drafter.accum_steps`` (4) cycles as
  a drafter commits its step; ``rtt_dispatcher_cpu_us`` is the dispatcher's CPU time per cycle
  (the target's job_ready and get_job included). ``rtt_floor``: the same request, as the wire
  encodes it, against a bare ZeroMQ echo in another process: the host's floor under that cycle.
- on CUDA hosts ``d2d`` (one GPU, in process) and ``cuda_ipc`` (a target's slot block opened by a
  drafter process; it includes a message per slot, as a real handoff does).

The processes are spawned, each with one intra-op thread. The figures are printed as a table, or as
one JSON object with ``--json``; progress goes to stderr. ``other_cpu_pct`` tells how much of the
CPUs the rest of the host used meanwhile: on a busy machine every figure is skewed.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import torch

from common.wire import messages
from common.wire.client import DispatcherClient, run_id_for
from common.run.config import Config, load_config
from common.dataplane.cuda_ipc import cuda_ipc_available
from common.dataplane.shm_arena import SHM_DIR, sweep_dead_segments
from common.dataplane.shm_segment import PoolSegment
from common.dataplane.transport_info import cuda_ipc_transport_info, shm_transport_info
from common.run.descriptors import TransportInfo
from common.dataplane.slots import SlotLayout, format_bytes
from benchmarks import protocol_workers, transport_workers as workers
from benchmarks.transport_table import RTT_P99_TARGET_MS, TARGETS, format_table
from benchmarks.transport_timeline import cpus_busy, describe as describe_timeline, summarize as summarize_timeline
from benchmarks.transport_workers import BenchSpec
from benchmarks.dispatcher_cpu import DispatcherCPU

SLOT_TOKENS = 8192
SLOT_LAYERS = 5
SLOT_DTYPE = "bfloat16"
NUM_SLOTS = 4
MAX_WARMUP_S = 0.5
RTT_CYCLES_PER_S = 1500  # control-plane cycles timed per second of --seconds ("a few thousand" by default)
MAX_ITEMS_PER_S = 3000  # generous bound on handoffs per second, to size the benchmark's job list
PHASE_TIMEOUT_S = 90.0  # beyond the measured time: process start-up, registration, warm-up
STEAL_WARN_PCT = 2.0  # CPU time the hypervisor took, in percent, above which the run is called skewed


def bench_layout(slot_mb: float) -> SlotLayout:
    """A slot whose hidden-state region is about ``slot_mb`` MiB: 8192 tokens × 5 layers × hidden."""
    if not (math.isfinite(slot_mb) and slot_mb > 0):
        raise ValueError(f"--slot-mb must be a positive number, got {slot_mb}")
    itemsize = torch.empty(0, dtype=getattr(torch, SLOT_DTYPE)).element_size()
    hidden_size = max(1, round(slot_mb * 2**20 / (SLOT_TOKENS * SLOT_LAYERS * itemsize)))
    return SlotLayout(tokens_per_batch=SLOT_TOKENS, num_layers=SLOT_LAYERS, hidden_size=hidden_size,
                      dtype=SLOT_DTYPE, max_seqs=1)


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class HostLoad:
    """CPU time the rest of the host used while the benchmark ran: a busy CI box skews every figure."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._cpu = psutil.cpu_times()
        self._own = self._own_cpu_s()

    @staticmethod
    def _own_cpu_s() -> float:
        # Children count once reaped; the benchmark joins every process it starts.
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def figures(self) -> dict[str, float]:
        cpu, capacity = psutil.cpu_times(), (time.monotonic() - self._started) * (os.cpu_count() or 1)
        busy = sum(getattr(cpu, f) - getattr(self._cpu, f) for f in ("user", "nice", "system", "irq", "softirq"))
        other = max(0.0, busy - (self._own_cpu_s() - self._own))
        return {"other_cpu_pct": 100 * other / capacity,
                "steal_pct": 100 * (getattr(cpu, "steal", 0.0) - getattr(self._cpu, "steal", 0.0)) / capacity}


def _dispatcher_config(run_dir: Path, layout: SlotLayout, num_jobs: int) -> Config:
    # One bucket as long as the token budget, its sequences padded to the bucket's length (batching
    # fixed, max_seqs 1): every job fills the whole slot, as every other path's item does. Padded to
    # each sample's own length (sorted), a job would move half a slot on average and the per-item
    # cost of the control plane would weigh twice as much.
    return load_config(None, [
        f"run.dir={run_dir}", f"target.hidden_size={layout.hidden_size}",
        f"target.num_capture_layers={layout.num_layers}", f"target.dtype={layout.dtype}",
        f"schedule.tokens_per_batch={layout.tokens_per_batch}", f"schedule.buckets=[{layout.tokens_per_batch}]",
        "schedule.batching=fixed",
        f"pool.slots={NUM_SLOTS}", "pool.min_ready=0", "pool.transport=shm",
        f"data.synthetic_samples={num_jobs}", "dispatcher.exit_when_done=false"])


def _reap(processes: list[Any], timeout_s: float = 10.0) -> None:
    """Join our children; SIGTERM, then SIGKILL, those that do not exit. Unclean exits are reported."""
    for proc in processes:
        if proc.pid is None:
            continue
        proc.join(timeout_s)
        if proc.is_alive():
            _progress(f"{proc.name} did not exit: terminating it")
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if proc.exitcode != 0:
            _progress(f"warning: {proc.name} exited with code {proc.exitcode}")


def _run_pair(ctx: Any, what: str, producer: Callable, producer_args: tuple, consumer: Callable,
              consumer_args: tuple, *, timeout_s: float, after_start: Callable[[], None] = lambda: None) -> dict:
    """Run one producer and one consumer process until the consumer reports its figures."""
    stop, results = ctx.Event(), ctx.Queue()
    processes = [ctx.Process(target=fn, args=(*args, stop, results), name=f"hsd-bench-{what}-{role}")
                 for role, fn, args in (("producer", producer, producer_args), ("consumer", consumer, consumer_args))]
    try:
        for proc in processes:
            proc.start()
        after_start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = results.get(timeout=0.2)
                break
            except queue.Empty:
                pass
            failed = [p for p in processes if p.exitcode is not None and p.exitcode != 0]
            if failed:
                raise RuntimeError(f"{what}: {failed[0].name} exited with code {failed[0].exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: no result within {timeout_s:.0f}s")
        if "error" in result:
            raise RuntimeError(f"{what} failed in a worker process:\n{result['error']}")
        return result
    finally:
        stop.set()
        _reap(processes)
        results.close()
        results.join_thread()


@contextmanager
def _dispatcher(ctx: Any, config: Config) -> Iterator[DispatcherCPU]:
    """A real dispatcher in a child process; SIGTERM at the end, after which its arena must be gone."""
    state_file = config.run_dir / "dispatcher.json"
    proc = ctx.Process(target=workers.serve_dispatcher, args=(config,), name="hsd-bench-dispatcher")
    proc.start()
    try:
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not state_file.exists():
            if proc.exitcode is not None:
                raise RuntimeError(f"the benchmark dispatcher exited with code {proc.exitcode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark dispatcher did not start")
            time.sleep(0.05)
        stats = DispatcherClient(config.stats_endpoint, secret=config.dispatcher.secret)
        try:
            yield DispatcherCPU(psutil.Process(proc.pid), stats)
        finally:
            stats.close()
    finally:
        if proc.is_alive():
            proc.terminate()
        _reap([proc])
        run_id = run_id_for(config.run_dir)
        swept = sweep_dead_segments(run_id)
        if swept:
            _progress(f"warning: removed the dispatcher's leftover shared memory {', '.join(swept)}")


def _measure_memcpy(spec: BenchSpec, *, num_buffers: int = 2, device: str = "cpu") -> float:
    # Every buffer written once first, so the loop copies between resident pages only.
    return workers.measure_copy(spec, workers.copy_buffers(spec, num_buffers, device))


def measure_memcpy_shared(ctx: Any, spec: BenchSpec, timeout_s: float) -> float:
    """One process's memcpy while a second process copies as well: the share of the memory bus each
    of the shm path's two copies (the target's write, the drafter's read) can have on this host."""
    return _run_pair(ctx, "memcpy_shared", workers.copy_until_stopped, (spec,), workers.copy_measured, (spec,),
                     timeout_s=timeout_s)["gbps"]


def _run_piped(ctx: Any, what: str, spec: BenchSpec, info: TransportInfo, producer_device: str,
               consumer_device: str, *, timeout_s: float) -> dict:
    """A target and a drafter of the transport ``info`` names, handing slots over through a pipe."""
    producer_end, consumer_end = ctx.Pipe()
    return _run_pair(ctx, what, workers.piped_target, (spec, info, producer_device, producer_end),
                     workers.piped_drafter, (spec, info, consumer_device, consumer_end), timeout_s=timeout_s,
                     after_start=lambda: (producer_end.close(), consumer_end.close()))


def measure_shm_piped(ctx: Any, spec: BenchSpec, timeout_s: float) -> float:
    """The shm data plane alone: the same slot copies as the shm path, a pipe in place of the
    dispatcher. What the control plane costs is the gap between the two; this one is the host's."""
    segment = PoolSegment(f"bench{secrets.token_hex(3)}", spec.layout, NUM_SLOTS)
    try:
        return _run_piped(ctx, "shm_piped", spec, shm_transport_info(segment), "cpu", "cpu", timeout_s=timeout_s)["gbps"]
    finally:
        segment.unlink()


def measure_cuda(ctx: Any, spec: BenchSpec, timeout_s: float) -> dict[str, Any]:
    figures: dict[str, Any] = {"d2d_gbps": _measure_memcpy(spec, device="cuda:0")}
    _progress(f"d2d copy on cuda:0: {figures['d2d_gbps']:.2f} GB/s")
    if not cuda_ipc_available():
        return figures
    consumer_index = 1 if torch.cuda.device_count() > 1 else 0  # different GPUs, as in a real run
    result = _run_piped(ctx, "cuda_ipc", spec, cuda_ipc_transport_info(spec.layout, NUM_SLOTS), "cuda:0",
                        f"cuda:{consumer_index}", timeout_s=timeout_s)
    figures["cuda_ipc_gbps"] = result["gbps"]
    figures["cuda_ipc_devices"] = f"cuda:0->cuda:{consumer_index}"
    _progress(f"cuda_ipc {figures['cuda_ipc_devices']}: {result['gbps']:.2f} GB/s")
    return figures


def _measure_shm_round(ctx: Any, spec: BenchSpec, config: Config, dispatcher: DispatcherCPU,
                       timeout_s: float) -> dict[str, float]:
    """One round of the alternation: a lone memcpy, a memcpy beside another copy, then the shm path,
    one after the other, so the shm path is judged against the memory bus of the same moments (a
    lone copy's speed varies by a third between runs on a shared host)."""
    memcpy = _measure_memcpy(spec)
    shared = measure_memcpy_shared(ctx, spec, timeout_s)
    target_stamps = config.run_dir / "timeline-target.json"
    result, cpu_s = dispatcher.while_running(lambda: _run_pair(
        ctx, "shm", protocol_workers.shm_target, (config, spec, True, str(target_stamps)),
        protocol_workers.shm_drafter, (config, spec), timeout_s=timeout_s))
    timeline = summarize_timeline(json.loads(target_stamps.read_text()), result.pop("timeline"),
                                  since_ns=result.pop("window_start_ns"))
    target_stamps.unlink()
    cpu_ms = 1e3 * cpu_s / result["items_run"]
    timeline["cpus_busy"] = cpus_busy(timeline, cpu_ms, os.cpu_count() or 1)
    item_mb = result["gbps"] * 1e3 * result["elapsed_s"] / result["items"]
    items_run = result["items_run"]
    loop_us = {what: 1e6 * s / items_run for what, s in sorted(dispatcher.loop_cpu_s.items(), key=lambda kv: -kv[1])}
    messages_per_item = {op: n / items_run for op, n in sorted(dispatcher.requests.items())}
    wakeups_per_item = dispatcher.wakeups / items_run
    _progress(f"memcpy {memcpy:.2f} GB/s, beside another copy {shared:.2f}; shm {result['gbps']:.2f} GB/s, "
              f"{result['items']} items of {item_mb:.1f} MB; the drafter copies at {result['copy_gbps']:.2f} GB/s and "
              f"spends {result['control_ms']:.2f} ms per item in get_hs/consumed/commit_step (a commit every "
              f"{config.drafter.accum_steps} items); the dispatcher's CPU {cpu_ms:.2f} ms per item")
    _progress(describe_timeline(timeline))
    _progress("the dispatcher's loop, us an item: " + ", ".join(f"{what} {us:.0f}" for what, us in loop_us.items())
              + "; messages an item: " + ", ".join(f"{op} {n:.2f}" for op, n in messages_per_item.items())
              + f"; wake-ups an item {wakeups_per_item:.2f}")
    return {"memcpy_gbps": memcpy, "memcpy_shared_gbps": shared, "shm_gbps": result["gbps"],
            "shm_copy_gbps": result["copy_gbps"], "shm_control_ms": result["control_ms"],
            "shm_dispatcher_cpu_ms": cpu_ms, "shm_dispatcher_loop_us_per_item": loop_us,
            "shm_dispatcher_messages_per_item": messages_per_item, "shm_dispatcher_wakeups_per_item": wakeups_per_item,
            "shm_vs_memcpy": result["gbps"] / memcpy, "shm_vs_memcpy_shared": result["gbps"] / shared,
            "memcpy_shared_vs_memcpy": shared / memcpy, "shm_timeline": timeline}


def _measure_protocol(ctx: Any, spec: BenchSpec, config: Config, *, rounds: int, num_rtt_cycles: int,
                      timeout_s: float) -> dict[str, Any]:
    """The shm arena and the control plane, against one real dispatcher: ``rounds`` alternated rounds
    of :func:`_measure_shm_round` (each figure the median of its rounds, each ratio the median of
    the rounds' own ratios), then the round trip."""
    figures: dict[str, Any] = {}
    with _dispatcher(ctx, config) as dispatcher:
        per_round = []
        for index in range(rounds):
            if rounds > 1:
                _progress(f"round {index + 1} of {rounds}")
            per_round.append(_measure_shm_round(ctx, spec, config, dispatcher, timeout_s))
        figures.update({key: statistics.median(r[key] for r in per_round) for key in per_round[0]
                        if not isinstance(per_round[0][key], dict)})
        # the timeline (and the dispatcher's loop by op) of the round whose shm figure is the median
        # (the upper one of an even count)
        median_round = sorted(per_round, key=lambda r: r["shm_gbps"])[len(per_round) // 2]
        figures.update({key: value for key, value in median_round.items() if isinstance(value, dict)})
        figures["rounds"] = per_round
        result, cpu_s = dispatcher.while_running(lambda: _run_pair(
            ctx, "rtt", protocol_workers.shm_target, (config, spec, False, None),
            protocol_workers.rtt_drafter, (config, spec, num_rtt_cycles), timeout_s=timeout_s))
        cycles_run = result.pop("rtt_cycles_run")
        figures.update(result, rtt_accum_steps=config.drafter.accum_steps,
                       rtt_dispatcher_cpu_us=1e6 * cpu_s / cycles_run)
        _progress(f"rtt get_hs carrying consumed: p50 {result['rtt_p50_ms']:.3f} ms, p99 {result['rtt_p99_ms']:.3f} ms "
                  f"({result['rtt_cycles']} cycles, {result['rtt_waited']} waited); the dispatcher's CPU "
                  f"{figures['rtt_dispatcher_cpu_us']:.0f} us per cycle")
    return figures


def measure_rtt_floor(ctx: Any, tmp: Path, num_cycles: int, timeout_s: float) -> dict[str, Any]:
    """A get_hs carrying a consumed report as the wire encodes it, against a bare echo answering with a grant."""
    job = messages.Job(job_id=1, epoch=0, bucket=3, seq_len=2048, samples=[101, 102, 103], lengths=[2000, 1900, 1800],
                       num_tokens=5700, slot=2, generation=7, owner=None, grant=9)
    reply = messages.encode(messages.GrantReply(id=1, job=job, done=False))
    requests = (messages.encode(messages.GetHS(id=1, worker_id="drafter-1", token="0" * 32, wait_ms=0, consumed=[1])),)
    endpoint = f"ipc://{tmp / 'echo.sock'}"
    return _run_pair(ctx, "rtt_floor", workers.zmq_echo, (endpoint, reply), workers.zmq_echo_client,
                     (endpoint, requests, num_cycles), timeout_s=timeout_s)


def _measure_alternatives(ctx: Any, spec: BenchSpec, tmp: Path, *, timeout_s: float) -> dict[str, Any]:
    """A torch.multiprocessing Queue (as usually called, and at its best) and ZeroMQ over ipc://."""
    figures: dict[str, Any] = {}
    for key, shared_alloc in (("torch_mp_queue_gbps", False), ("torch_mp_queue_shared_gbps", True)):
        items, drained = ctx.Queue(maxsize=4), ctx.Event()  # bounded: at most four items in flight
        result = _run_pair(ctx, key[:-5], workers.queue_producer, (spec, shared_alloc, items, drained),
                           workers.queue_consumer, (spec, items, drained), timeout_s=timeout_s)
        items.close()
        figures[key] = result["gbps"]
        _progress(f"{key[:-5]}: {result['gbps']:.2f} GB/s, {result['items']} items")
    endpoint = f"ipc://{tmp / 'zmq.sock'}"
    result = _run_pair(ctx, "zmq_ipc", workers.zmq_producer, (spec, endpoint),
                       workers.zmq_consumer, (spec, endpoint), timeout_s=timeout_s)
    figures["zmq_ipc_gbps"] = result["gbps"]
    _progress(f"zmq_ipc: {result['gbps']:.2f} GB/s, {result['items']} items")
    return figures


def measure(*, slot_mb: float, seconds: float, rounds: int = 1) -> dict[str, Any]:
    """Run every measurement; returns the figures (the keys of ``--json``)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--seconds must be a positive number, got {seconds}")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    torch.set_num_threads(1)
    layout = bench_layout(slot_mb)
    needed = (NUM_SLOTS + 2) * layout.slot_bytes  # the arena plus each side's own copy
    available = min(psutil.virtual_memory().available, shutil.disk_usage(SHM_DIR).free)
    if needed > available:
        raise ValueError(f"--slot-mb {slot_mb:g} needs {format_bytes(needed)} of memory ({NUM_SLOTS} slots in "
                         f"{SHM_DIR} and one slot-sized copy on each side); this host has {format_bytes(available)}")
    spec = BenchSpec(layout, seconds=seconds, warmup_s=min(MAX_WARMUP_S, seconds / 4))
    timeout_s = PHASE_TIMEOUT_S + spec.warmup_s + seconds
    num_rtt_cycles = max(200, round(RTT_CYCLES_PER_S * seconds))
    num_jobs = round(MAX_ITEMS_PER_S * (rounds + 1) * (seconds + spec.warmup_s)) + 2 * num_rtt_cycles + 1000
    ctx = torch.multiprocessing.get_context("spawn")
    load = HostLoad()
    figures: dict[str, Any] = {"slot_bytes": layout.slot_bytes, "hs_bytes": layout.hs_bytes,
                               "seconds": seconds, "num_cpus": os.cpu_count()}
    _progress(f"{layout.describe()}; {seconds:g} s per path after {spec.warmup_s:g} s warm-up")

    # Two slot-sized buffers can sit largely in a server's last-level cache; the shm path cycles
    # through the source, every slot and the destination, so it streams from DRAM. This is the
    # same copy over that much memory: the limit the shm path can really approach.
    figures["memcpy_uncached_buffers"] = num_buffers = NUM_SLOTS + 2
    figures["memcpy_uncached_gbps"] = _measure_memcpy(spec, num_buffers=num_buffers)
    _progress(f"memcpy over {num_buffers} buffers: {figures['memcpy_uncached_gbps']:.2f} GB/s")
    tmp = Path(tempfile.mkdtemp(prefix="hsd_bench_"))
    try:
        config = _dispatcher_config(tmp / "run", layout, num_jobs)
        figures.update(_measure_protocol(ctx, spec, config, rounds=rounds, num_rtt_cycles=num_rtt_cycles,
                                         timeout_s=timeout_s))
        figures["shm_piped_gbps"] = measure_shm_piped(ctx, spec, timeout_s)
        _progress(f"shm_piped (the same copies, a pipe for the dispatcher): {figures['shm_piped_gbps']:.2f} GB/s")
        figures.update(measure_rtt_floor(ctx, tmp, num_rtt_cycles, timeout_s))
        _progress(f"rtt_floor (the same request against a bare echo): p50 {figures['rtt_floor_p50_ms']:.3f} ms, "
                  f"p99 {figures['rtt_floor_p99_ms']:.3f} ms")
        figures.update(_measure_alternatives(ctx, spec, tmp, timeout_s=timeout_s))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if torch.cuda.is_available():
        figures.update(measure_cuda(ctx, spec, timeout_s))

    figures.update(load.figures())
    if figures["other_cpu_pct"] > 5:
        _progress(f"other processes used {figures['other_cpu_pct']:.0f}% of the CPUs during the run: "
                  f"every figure is skewed, run again on a quiet host")
    if figures["steal_pct"] > STEAL_WARN_PCT:
        _progress(f"the hypervisor took {figures['steal_pct']:.1f}% of the CPUs from this VM during the run: the "
                  f"round trip's tail is skewed the most, run again when the host is quieter")
    memcpy, shm = figures["memcpy_gbps"], figures["shm_gbps"]
    figures.update(shm_vs_memcpy_uncached=shm / figures["memcpy_uncached_gbps"],
                   shm_vs_shm_piped=shm / figures["shm_piped_gbps"],
                   shm_piped_vs_memcpy=figures["shm_piped_gbps"] / memcpy,
                   shm_vs_torch_mp_queue=shm / figures["torch_mp_queue_gbps"],
                   shm_vs_torch_mp_queue_shared=shm / figures["torch_mp_queue_shared_gbps"],
                   shm_vs_zmq_ipc=shm / figures["zmq_ipc_gbps"])
    figures["targets_met"] = {**{key: figures[key] >= bound for key, bound in TARGETS.items()},
                              "rtt_p99_ms": figures["rtt_p99_ms"] <= RTT_P99_TARGET_MS}
    return figures


def run_transport_bench(*, slot_mb: float = 64.0, as_json: bool = False, seconds: float = 2.0, rounds: int = 1) -> int:
    figures = measure(slot_mb=slot_mb, seconds=seconds, rounds=rounds)
    print(json.dumps(figures) if as_json else format_table(figures))
    return 0
