"""``hsd bench scale``: one real dispatcher against many simulated workers over real sockets.

Each step of the sweep (``--workers 16,64,256,1024``) starts a fresh dispatcher in its own process
(``hsd dispatcher``: its run directory and journal on disk, ZeroMQ over ipc://, the shm arena of a
one-token-wide layout, so no hidden-state byte moves) and ``--clients`` client processes that hold
the step's workers between them, each with a socket of its own (:mod:`benchmarks.scale_clients`).
The workers follow a GPU model (:class:`benchmarks.scale_model.GpuModel`): a target GPU captures
``--tokens-per-s`` tokens a second in jobs of ``--job-tokens``, a drafter GPU trains
``--drafter-rate`` micro-batches a second; a step's workers are split into as few drafters as
consume what its targets produce with a quarter to spare. Jobs' times vary ±10 % and every worker
starts at a random moment of its period, so workers do not move in step. A heartbeat is due every
``dispatcher.heartbeat_s`` (``--heartbeat-s``) and goes out when the worker sent no request within
that interval, as a real worker's does (:mod:`common.wire.heartbeats`).

After every worker registered and ``--warmup`` seconds, a window of ``--seconds`` is measured:

- ``items_per_s``: jobs reported ready (the targets' finished jobs in the dispatcher's stats: a
  ``job_ready`` of its own or carried by the next ``get_job``), against ``offered_items_per_s``
  (what the targets' GPUs would produce);
- ``dispatcher_cpu_us_per_item``: the dispatcher process's CPU time (every thread's time on a CPU,
  from its schedstat in nanoseconds; psutil's 10 ms ticks where the kernel keeps none) per item; ``loop_thread_cpu_us_per_item`` its socket loop's thread alone;
  ``thread_cpu_us_per_item`` by thread (``loop``; ``hsd-journal``: the journal's sync thread;
  ZeroMQ's ``ZMQbg/IO/0``; ``python``: any other Python thread, which keeps the process's name);
  ``messages_per_item`` by op (the dispatcher's request counters);
  ``loop_cpu_us_per_item`` the loop thread's CPU per item by what it went to (the dispatcher's
  ``loop_cpu_s``: each op's requests whole, ``poll``, ``serve``, ``expire``, ``sweep``, ...;
  docs/stats.md) and ``loop_cpu_us_per_request`` each op's per request; ``loop_wakeups_per_item``
  the loop's wake-ups per item and ``loop_cpu_us_per_wakeup`` its thread's CPU per wake-up (what a
  message arriving alone costs: the messages that share a wake-up add little);
- ``request_p50/p99/max_ms``: round trips the clients timed of get_job, job_ready (sent alone), heartbeat and
  commit_step (commit waits for the journal's fsync); ``latency_by_op`` each op's, get_hs too
  (a drafter's long poll: its time includes waiting for a ready slot);
- ``heartbeat_lag_p99_ms``: a heartbeat's reply after the moment it was due; ``heartbeat_age_max_s``
  the oldest heartbeat the dispatcher holds of any worker at the window's end;
- ``journal_bytes_per_s``: growth of the run directory's journal segments;
- ``projected_gpus_per_core``: target GPUs one dispatcher core serves at this GPU model,
  1 core ÷ CPU per item ÷ items per GPU per second;
- ``gpus_served_within_p99_ms`` (the whole sweep): the most GPUs' traffic a step served with request
  p99 within 10 ms and exactly once, measured where the projection above extrapolates;
- ``client_cpu_pct``: each client process's CPU (of one core); ``client_saturated`` when one
  exceeds 90 %: then the workers, not the dispatcher, may set the pace. ``steal_pct`` and
  ``other_cpu_pct`` (the rest of the host's use, of all its cores) say how busy the host was.
- the socket floor (:mod:`benchmarks.scale_floor`, after the step; ``--no-floor`` skips it): a bare
  ZeroMQ echo answering the step's connections at its request rate, ``floor_cpu_us_per_request``
  (``floor_loop_us_per_request``, ``floor_io_us_per_request``) and ``floor_requests_per_wakeup``;
  ``floor_cpu_us_per_item`` is the floor times the step's ``requests_per_item`` (what the sockets
  alone cost an item), ``over_floor`` the dispatcher's ``dispatcher_cpu_us_per_request`` ÷ the floor's.

With ``--load L`` (a list, a step each for every ``--workers`` step) every simulated worker runs at
L times the GPU model's rates: its jobs come L times as fast and its heartbeats are due L times as
often (``dispatcher.heartbeat_s`` ÷ L), so it sends the requests of L workers through one connection
and 1,024 connections carry the traffic of thousands of GPUs, which a 2-core box could not hold as
processes. ``gpus_served`` counts the target GPUs of the stated model whose items the dispatcher
handled (items/s ÷ items per GPU per second); ``projected_gpus_per_core`` counts them too. A
dispatcher that idles between messages spends more per item than a busy one (its code and data go
cold between wake-ups), so the CPU per item of a lightly loaded step overstates what a busier one
costs: a load sweep measures it at the load it is projected to.

The workers register as if from other nodes (``scale-node-K``), as a thousand GPUs' workers are:
the dispatcher tells their liveness by heartbeats alone. With ``--same-host`` they name this host,
and the dispatcher's sweep checks each one's process every 0.25 s, as for workers on its own node.

Exactly once: every job id the drafters committed is committed once (``duplicates``).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks.scale_clients import ClientPlan, run_clients
from benchmarks.scale_floor import FloorPlan, measure_floor
from benchmarks.scale_model import REQUEST_P99_TARGET_MS, GpuModel, gpus_served_in_time, step_figures
from benchmarks.scale_table import format_step, table_header
from benchmarks.thread_cpu import cpu_ns_by_thread_name, thread_cpu_ns
from common.dataplane.shm_segment import list_segments, sweep_dead_segments
from common.run.config import Config, DispatcherSection, load_config
from common.run.records.rundir import read_state_file
from common.wire import messages
from common.wire.client import DispatcherClient, run_id_for
from common.wire.stats_figures import counter_delta

BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # the dispatcher bench's synthetic mix: ~3.3 samples a 16k job
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
JOURNAL_GLOB = "journal*.jsonl"


@dataclass(frozen=True)
class ScaleOptions:
    workers: tuple[int, ...]
    seconds: float = 5.0
    warmup_s: float = 2.0
    clients: int = 2
    model: GpuModel = GpuModel()
    heartbeat_s: float | None = None  # None: dispatcher.heartbeat_s's default
    work_dir: str | None = None
    seed: int = 0
    # The workers register from this host's name: the dispatcher's sweep (every 0.25 s) then checks
    # each one's process, as it does for workers on its own node. By default they name hosts of their
    # own, as the workers of a thousand GPUs on other nodes do, whose liveness only heartbeats tell.
    same_host: bool = False
    # Multiples of the GPU model's rates, a step each (for every --workers step): one simulated worker
    # then stands for `load` workers (its jobs come `load` times as fast, its heartbeats are due `load`
    # times as often), so the traffic of 3,000+ GPUs fits in the connections 2 client cores can hold.
    loads: tuple[float, ...] = (1.0,)
    # After each step, a bare ZeroMQ echo answers the step's connections at its request rate
    # (benchmarks.scale_floor): what any Python loop over ZeroMQ pays a request on this host.
    floor: bool = True
    # The drafters as a fraction of what keeps up with the targets (GpuModel.split): below 1 a
    # drafter-bound run, the pool full and every target's get_job waiting for a slot.
    drafter_fraction: float = 1.0


def _progress(message: str) -> None:
    print(f"[bench scale] {message}", file=sys.stderr, flush=True)


def dispatcher_overrides(run_dir: Path, options: ScaleOptions, targets: int, drafters: int,
                         load: float = 1.0) -> list[str]:
    model = options.model.scaled(load)
    offered = targets * model.target_jobs_per_s
    # Samples for every job the step can ask for (an epoch that ends starts the next one: 1000 of them).
    samples = max(2000, math.ceil(4 * offered * (options.seconds + options.warmup_s + START_TIMEOUT_S)))
    overrides = [
        f"run.dir={run_dir}", "run.epochs=1000", f"run.seed={options.seed}", f"data.synthetic_samples={samples}",
        f"schedule.tokens_per_batch={model.job_tokens}",
        f"schedule.buckets=[{','.join(str(b) for b in BUCKETS if b <= model.job_tokens) or model.job_tokens}]",
        "target.hidden_size=1", "target.num_capture_layers=1", f"target.count={targets}", f"drafter.count={drafters}",
        "pool.transport=shm", "pool.min_ready=0", f"pool.slots={targets * 2 + drafters * 2 + 4}",
        "dispatcher.exit_when_done=false"]
    heartbeat_s = options.heartbeat_s if options.heartbeat_s is not None else DispatcherSection().heartbeat_s
    if options.heartbeat_s is not None or load != 1:
        overrides.append(f"dispatcher.heartbeat_s={heartbeat_s / load:g}")
    return overrides


class Dispatcher:
    """``hsd dispatcher`` in a process of its own; SIGTERM at the end."""

    def __init__(self, config: Config, overrides: list[str]):
        self.config = config
        self.log_path = config.run_dir / "dispatcher.log"
        config.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "hsd.cli", "dispatcher", *overrides],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.process = psutil.Process(self.proc.pid)
        self.stats_client: DispatcherClient | None = None

    def wait_started(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while read_state_file(self.config.run_dir) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the dispatcher exited with code {self.proc.returncode} while starting: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the dispatcher did not start within {START_TIMEOUT_S:.0f}s: {self.log_tail()}")
            time.sleep(0.05)
        self.stats_client = DispatcherClient(self.config.stats_endpoint, secret=self.config.dispatcher.secret)

    def stats(self) -> messages.Snapshot:
        assert self.stats_client is not None
        return self.stats_client.call(messages.Stats(), timeout_s=30.0).stats

    def cpu(self) -> tuple[float, float]:
        """(every thread's CPU seconds, the main thread's: the socket loop). From each thread's
        ``schedstat`` (nanoseconds) where the kernel keeps it: the clock ticks psutil reads are 10 ms
        each, coarser than a short step's whole use."""
        per_thread = thread_cpu_ns(self.proc.pid)
        if per_thread:
            return sum(per_thread.values()) / 1e9, per_thread.get(self.proc.pid, 0) / 1e9
        threads = self.process.threads()
        total = sum(t.user_time + t.system_time for t in threads)
        loop = sum(t.user_time + t.system_time for t in threads if t.id == self.proc.pid)
        return total, loop

    def journal_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.config.run_dir.glob(JOURNAL_GLOB))

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int:
        if self.stats_client is not None:
            self.stats_client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _progress(f"the dispatcher did not stop within {STOP_TIMEOUT_S:.0f}s: killing it")
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Clients:
    """The client processes of one step, each holding its share of the workers."""

    def __init__(self, config: Config, options: ScaleOptions, targets: int, drafters: int, model: GpuModel):
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.pipes = [], []
        n = max(1, min(options.clients, targets + drafters))
        for k in range(n):
            plan = ClientPlan(endpoint=config.control_endpoint, secret=config.dispatcher.secret,
                              targets=[f"t{i}" for i in range(k, targets, n)],
                              drafters=[f"d{i}" for i in range(k, drafters, n)], model=model,
                              target_credits=config.pool.target_credits, seed=options.seed * 1000 + k,
                              host=socket.gethostname() if options.same_host else f"scale-node-{k}")
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=run_clients, args=(plan, child_end), name=f"hsd-bench-scale-client-{k}")
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.pipes.append(parent_end)
        self.ps = [psutil.Process(p.pid) for p in self.procs]

    def expect(self, kind: str, timeout_s: float) -> list[Any]:
        deadline, answers = time.monotonic() + timeout_s, []
        for proc, pipe in zip(self.procs, self.pipes):
            while not pipe.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before {kind}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name}: no {kind} within {timeout_s:.0f}s")
            message = pipe.recv()
            if message[0] != kind:
                raise RuntimeError(f"{proc.name} sent {message[0]!r}, expected {kind!r}")
            answers.append(message[1])
        return answers

    def send(self, *message: Any) -> None:
        for proc, pipe in zip(self.procs, self.pipes):
            try:
                pipe.send(message)
            except (BrokenPipeError, ConnectionResetError):  # the process already ended (sent its result, or failed)
                pass

    def cpu(self) -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in self.ps]

    def stop(self) -> None:
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                _progress(f"{proc.name} did not exit: terminating it")
                proc.terminate()
                proc.join(5)
            if proc.exitcode not in (0, None):
                _progress(f"warning: {proc.name} exited with code {proc.exitcode}")
        for pipe in self.pipes:
            pipe.close()


def _host_sample() -> tuple[Any, float]:
    return psutil.cpu_times(), time.monotonic()


def _host_figures(before: tuple[Any, float], after: tuple[Any, float], own_cpu_s: float) -> dict[str, float]:
    (t0, m0), (t1, m1) = before, after
    capacity = (m1 - m0) * (os.cpu_count() or 1)
    busy = sum(getattr(t1, f) - getattr(t0, f) for f in ("user", "nice", "system", "irq", "softirq"))
    return {"other_cpu_pct": 100 * max(0.0, busy - own_cpu_s) / capacity,
            "steal_pct": 100 * (getattr(t1, "steal", 0.0) - getattr(t0, "steal", 0.0)) / capacity,
            "load_avg_1m": os.getloadavg()[0]}


def run_step(options: ScaleOptions, workers: int, step_dir: Path, load: float = 1.0) -> dict[str, Any]:
    targets, drafters = options.model.split(workers, options.drafter_fraction)
    overrides = dispatcher_overrides(step_dir, options, targets, drafters, load)
    config = load_config(None, overrides)
    at_load = f", each at {load:g}× the GPU model's rates" if load != 1 else ""
    _progress(f"{workers} workers ({targets} targets, {drafters} drafters{at_load}) in {options.clients} client "
              f"processes")
    dispatcher = Dispatcher(config, overrides)
    clients: Clients | None = None
    try:
        dispatcher.wait_started()
        clients = Clients(config, options, targets, drafters, options.model.scaled(load))
        clients.expect("registered", START_TIMEOUT_S + workers / 20)
        time.sleep(options.warmup_s)
        t0 = time.monotonic() + 0.3
        t1 = t0 + options.seconds
        clients.send("window", t0, t1)
        time.sleep(max(0.0, t0 - time.monotonic() - 0.2))
        stats0 = dispatcher.stats()  # before the window: a snapshot's own cost is not the items'
        time.sleep(max(0.0, t0 - time.monotonic()))
        threads0 = cpu_ns_by_thread_name(dispatcher.proc.pid)
        cpu0, client0, journal0, host0 = dispatcher.cpu(), clients.cpu(), dispatcher.journal_bytes(), _host_sample()
        time.sleep(max(0.0, t1 - time.monotonic()))
        cpu1, client1, journal1, host1 = dispatcher.cpu(), clients.cpu(), dispatcher.journal_bytes(), _host_sample()
        threads1 = cpu_ns_by_thread_name(dispatcher.proc.pid)
        window_s = host1[1] - host0[1]
        stats1 = dispatcher.stats()
        clients.send("stop")
        results = clients.expect("result", STOP_TIMEOUT_S)
    finally:
        try:
            if clients is not None:
                clients.send("stop")
                clients.stop()
        finally:
            exit_code = dispatcher.stop()  # whatever the clients did: no dispatcher outlives its step
    left = [s.name for s in list_segments(run_id_for(config.run_dir))]
    if left:
        sweep_dead_segments(run_id_for(config.run_dir))
        _progress(f"warning: the dispatcher left shared memory {', '.join(left)}")
    latencies: dict[str, list[float]] = {}
    for result in results:
        for op, values in result["latencies_ms"].items():
            latencies.setdefault(op, []).extend(values)
    committed = [job for result in results for job in result["committed"]]
    errors: dict[str, int] = {}
    for result in results:
        for code, n in result["errors"].items():
            errors[code] = errors.get(code, 0) + n
    client_cpu = [b - a for a, b in zip(client0, client1)]
    dispatcher_cpu, loop_cpu = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    figures = step_figures(
        model=options.model, load=load, targets=targets, drafters=drafters, window_s=window_s,
        dispatcher_cpu_s=dispatcher_cpu, loop_thread_cpu_s=loop_cpu,
        items=_target_jobs(stats1) - _target_jobs(stats0),
        requests=counter_delta(stats0.requests, stats1.requests),
        given_back=counter_delta(stats0.given_back, stats1.given_back), journal_bytes=journal1 - journal0,
        latencies_ms=latencies, heartbeat_lag_ms=[ms for r in results for ms in r["heartbeat_lag_ms"]],
        heartbeat_age_max_s=max((w.heartbeat_age_s for w in stats1.workers), default=math.nan),
        client_cpu_s=client_cpu, host=_host_figures(host0, host1, dispatcher_cpu + sum(client_cpu)),
        committed=len(committed), duplicates=len(committed) - len(set(committed)), errors=errors,
        late_wakeups=sum(r["late_wakeups"] for r in results))
    items = figures["items"]
    loop_cpu_s = counter_delta(stats0.loop_cpu_s, stats1.loop_cpu_s)
    figures["loop_cpu_us_per_item"] = {what: 1e6 * s / items for what, s in
                                       sorted(loop_cpu_s.items(), key=lambda kv: -kv[1])} if items else {}
    figures["loop_cpu_us_per_request"] = {op: 1e6 * loop_cpu_s[op] / n for op, n in figures["requests"].items()
                                          if n and op in loop_cpu_s}
    wakeups = stats1.loop_wakeups - stats0.loop_wakeups
    figures["loop_wakeups_per_item"] = wakeups / items if items else math.nan
    figures["loop_cpu_us_per_wakeup"] = 1e6 * loop_cpu / wakeups if wakeups else math.nan
    figures["thread_cpu_us_per_item"] = {
        name: (ns - threads0.get(name, 0)) / 1e3 / items for name, ns in sorted(threads1.items())
        if items and ns > threads0.get(name, 0)}
    figures.update(heartbeat_s=config.dispatcher.heartbeat_s, registered=len(stats1.workers),
                   lost_workers=sum(r["lost"] for r in results), dispatcher_exit_code=exit_code,
                   shm_left=len(left),
                   error_examples={code: text for r in results for code, text in r["error_examples"].items()})
    if options.floor and items:
        figures.update(floor_figures(figures, options, step_dir))
    return figures


def floor_figures(figures: dict[str, Any], options: ScaleOptions, step_dir: Path) -> dict[str, Any]:
    """The socket floor at this step's connections and request rate, and the step set against it:
    ``dispatcher_cpu_us_per_request`` (every thread), ``floor_cpu_us_per_item`` (the floor a request
    times the step's requests an item: the least an item costs at this message count) and
    ``over_floor`` (the dispatcher's CPU a request ÷ the floor's)."""
    requests = sum(figures["requests"].values())
    rate = requests / figures["window_s"]
    _progress(f"socket floor: a bare echo answering {figures['workers']} connections at {rate:,.0f} requests/s")
    floor = measure_floor(FloorPlan(endpoint=f"ipc://{step_dir / 'floor.sock'}", connections=figures["workers"],
                                    requests_per_s=rate, clients=options.clients,
                                    warmup_s=min(options.warmup_s, 2.0), seconds=options.seconds,
                                    seed=options.seed))
    requests_per_item = requests / figures["items"]
    per_request = figures["dispatcher_cpu_us_per_item"] / requests_per_item if requests else math.nan
    floor_per_request = floor["floor_cpu_us_per_request"]
    return {**floor, "requests_per_item": requests_per_item, "dispatcher_cpu_us_per_request": per_request,
            "floor_cpu_us_per_item": floor_per_request * requests_per_item,
            "over_floor": per_request / floor_per_request if floor_per_request > 0 else math.nan}


def _target_jobs(stats: messages.Snapshot) -> int:
    """Jobs the registered targets finished (reported ready, alone or on a get_job)."""
    return sum(w.jobs for w in stats.workers if w.role == "target")


def run_scale_bench(options: ScaleOptions, *, as_json: bool) -> int:
    """Every step of the sweep, one after another; the table (or one JSON object) on stdout."""
    work_dir = Path(tempfile.mkdtemp(prefix="scale-", dir=options.work_dir or None))  # short: ipc paths <= 100 bytes
    steps: list[dict[str, Any]] = []
    if not as_json:
        print(table_header(options.model), flush=True)
    try:
        steps_to_run = [(workers, load) for workers in options.workers for load in options.loads]
        for index, (workers, load) in enumerate(steps_to_run):
            figures = run_step(options, workers, work_dir / f"s{index}", load)
            steps.append(figures)
            if not as_json:
                print(format_step(figures), flush=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    failed = [s for s in steps if s["duplicates"] or s["dispatcher_exit_code"] != 0 or s["shm_left"]]
    in_time = gpus_served_in_time(steps)
    if as_json:
        print(json.dumps(json_safe({"model": {**asdict(options.model), "job_s": options.model.job_s,
                                    "target_jobs_per_s": options.model.target_jobs_per_s},
                          "loads": list(options.loads), "seconds": options.seconds, "warmup_s": options.warmup_s, "clients": options.clients,
                          "cpu_count": os.cpu_count(), "same_host": options.same_host,
                          "drafter_fraction": options.drafter_fraction,
                          "gpus_served_within_p99_ms": {"p99_ms": REQUEST_P99_TARGET_MS, "gpus": in_time},
                          "steps": steps}), indent=2))
    else:
        print(f"served within request p99 {REQUEST_P99_TARGET_MS:g} ms: " + (
            f"the traffic of {in_time:,.0f} target GPUs of the stated model (the busiest such step)"
            if in_time is not None else "no step"))
    return 1 if failed else 0


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity as None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
