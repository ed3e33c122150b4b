"""``hsd bench dispatcher``: the real dispatcher core at a million jobs an epoch, in-process.

Simulated clients call ``DispatcherCore`` as the socket loop would, at full speed, with
``time.monotonic()`` as now: targets (get_job -> job_ready), drafters training named models (get_hs
-> consumed, a commit_step every ``accum`` micro-batches, a checkpoint every ``checkpoint_every``
steps), and a sweep plus ``maybe_snapshot`` every 0.25 s as the server does. The next epoch is built
in the child process, the journal syncs on its thread, as in production. Halfway through, a
give-back storm: a target and a drafter die holding jobs (the drafter's model reloads its
checkpoint and registers again, which rolls the ledger back), and another target and drafter hang
until their leases expire. After the last epoch the core is closed and a new one is timed on the
same run directory (snapshot + journal replay) up to its first answer.

Every core call is timed into a constant-size histogram; exactly-once is judged by the models' own
witness: each model keeps the ids it trained on (a full list for small runs, an order-free digest
of the multiset otherwise), reloaded with its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import psutil

from benchmarks.latency import LatencyHistogram
from benchmarks.load_clients import SimDrafter, SimModel, SimTarget, mix64_array
from benchmarks.pool_pick import pick_section
from common.mix import MASK64
from common.run.config import opt
from common.run.records.job_ids import make_job_id
from common.run.records.lengths import SYNTHETIC_SHARES, synthetic_lengths
from common.wire.messages import ModelClaim
from dispatcher.allocator import pin_mmap_threshold
from dispatcher.core import DispatcherCore
from dispatcher.core_types import DONE, CoreOptions
from dispatcher.journal import Journal
from dispatcher.ledger import LedgerError
from dispatcher.pool import HSPool

BUCKETS = [256, 512, 1024, 2048, 4096, 8192]
TOKENS_PER_BATCH = 16384
SWEEP_INTERVAL_S = 0.25      # the server's sweep period
FULL_WITNESS_UP_TO = 200_000  # jobs in the run below which models keep every trained id (exact check)
_clock = time.perf_counter  # looked up once: the timer wraps every one of millions of calls
STALL_LIMIT_S = 60.0          # no job committed for this long: the run is stuck, stop with the state


@dataclass
class DispatcherLoadOptions:
    jobs: int = opt(1_000_000, "Jobs per epoch (the sample count is chosen so the schedule holds about this many).")
    epochs: int = opt(3, "Epochs to run to the end.")
    targets: int = opt(4, "Simulated target workers.")
    drafters: int = opt(3, "Simulated drafters, each training a model of its own.")
    accum: int = opt(4, "Micro-batches per optimizer step.")
    checkpoint_every: int = opt(50, "A drafter checkpoints its model every this many steps.")
    slots: int = opt(24, "Hidden-state slots in the pool.")
    min_ready: int = opt(6, "pool.min_ready.")
    credits: int = opt(2, "pool.target_credits.")
    lease_s: float = opt(2.0, "Lease of one job; the storm's hung workers lose theirs after it.")
    seed: int = opt(0, "Run seed (lengths and schedules).")
    dir: str = opt("", "Directory for the temporary run directory (default: the system's temp dir).")

    def check(self) -> None:
        if self.jobs < 10:
            raise ValueError(f"--jobs must be at least 10, got {self.jobs}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.epochs}")
        if self.targets < 2 or self.drafters < 2:
            raise ValueError("the give-back storm needs at least 2 targets and 2 drafters")
        if self.min_ready >= self.slots:
            raise ValueError(f"--min-ready ({self.min_ready}) must be below --slots ({self.slots})")


def samples_for_jobs(num_jobs: int) -> int:
    """Samples whose synthetic mix fills about ``num_jobs`` batches (each bucket's share / batch size)."""
    shares = np.asarray(SYNTHETIC_SHARES[:len(BUCKETS)], dtype=np.float64)
    batch_sizes = np.asarray([TOKENS_PER_BATCH // b for b in BUCKETS], dtype=np.float64)
    return int(round(num_jobs / float((shares / shares.sum() / batch_sizes).sum())))


class DispatcherLoad:
    def __init__(self, options: DispatcherLoadOptions, run_dir: str, log: Callable[[str], None]):
        self.o, self.run_dir, self.log = options, run_dir, log
        self.ops: dict[str, LatencyHistogram] = {}
        self.giveback = LatencyHistogram()
        self.process = psutil.Process()
        self.rss_mb: list[float] = []
        self.epoch_wall_s: list[float] = []
        self.build_started: dict[int, float] = {}
        self.build_s: dict[int, float] = {}
        self.build_waits = 0
        self.refused = Counter()
        self.next_pid = 1000

    # -- timing ------------------------------------------------------------------------------
    def call(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = _clock() - start
            hist = self.ops.get(kind)
            if hist is None:
                hist = self.ops[kind] = LatencyHistogram()
            hist.add(elapsed)

    def storm_call(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = self.call(kind, fn, *args, **kwargs)
        self.giveback.add(time.perf_counter() - start)
        return result

    # -- setup -------------------------------------------------------------------------------
    def make_core(self, lengths: np.ndarray) -> DispatcherCore:
        o = self.o
        options = CoreOptions(lease_s=o.lease_s, worker_timeout_s=1e9, epochs=o.epochs, run_seed=o.seed,
                              buckets=list(BUCKETS), tokens_per_batch=TOKENS_PER_BATCH, order="interleave",
                              build_ahead=True)
        pool = HSPool(min_ready=o.min_ready, target_credits=o.credits, pull="deficit", seed=o.seed)
        return DispatcherCore(options, run_dir=self.run_dir, lengths=lengths,
                              journal=Journal(self.run_dir, sync_in_background=True), pool=pool,
                              shared_slots=o.slots, now=time.monotonic())

    def register(self, role: str, name: str, model: SimModel | None = None) -> str:
        self.next_pid += 1
        fields = {"model": ModelClaim(id=model.id, step=model.step)} if model is not None else {}
        worker = self.storm_call("register", self.core.register, role=role, name=name, pid=self.next_pid, host="bench",
                                 gpu=None, now=time.monotonic(), **fields)
        return worker.id

    def watch_builds(self) -> None:
        """Time each build from its request (the epoch before it started) to its end, in the child."""
        following = max(self.core.epoch_jobs) + 1
        for epoch in [e for e in self.build_started if e < following and e not in self.build_s]:
            # it started between two sweeps, so its build ended by now: an upper bound of its time
            self.build_s[epoch] = time.monotonic() - self.build_started[epoch]
        builder = self.core.store.builder
        if following >= self.o.epochs or not builder.requested(following):
            return
        if following not in self.build_started:
            self.build_started[following] = time.monotonic()
        elif following not in self.build_s and builder.ready(following):  # polled each sweep: ±0.25 s
            self.build_s[following] = time.monotonic() - self.build_started[following]

    # -- the simulated workers ---------------------------------------------------------------
    def target_turn(self, t: SimTarget, now: float) -> None:
        core = self.core
        for job_id, generation in t.extracting:
            try:
                self.call("job_ready", core.job_ready, t.id, job_id, generation, 0.001, now)
            except LedgerError:
                self.refused["job_ready"] += 1
        t.extracting = []
        while True:
            grant = self.call("get_job", core.get_job, t.id, now)
            if grant == DONE:
                t.finished = True
                return
            if grant is None:
                following = max(core.epoch_jobs) + 1
                if (core.ledger.num_pending == 0 and following < self.o.epochs
                        and not core.store.builder.ready(following)):
                    self.build_waits += 1
                return
            t.extracting.append((grant.job.job_id, grant.job.generation))

    def drafter_turn(self, d: SimDrafter, now: float) -> None:
        core = self.core
        if d.training is not None:  # back from a hang: its lease expired, the job went back to ready
            try:
                self.call("consumed", core.consumed, d.id, d.training, now)
                d.window.append(d.training)
            except LedgerError:
                self.refused["consumed"] += 1
            d.training = None
        flush = False
        for _ in range(self.o.accum - len(d.window)):
            grant, flush = self.call("get_hs", core.get_hs, d.id, now)
            if grant == DONE:
                d.finished = True
                return
            if grant is None:
                break
            self.call("consumed", core.consumed, d.id, grant.job.job_id, now)
            d.window.append(grant.job.job_id)
        if d.window and (len(d.window) == self.o.accum or flush):
            self.commit(d, now)
        elif not d.window and core.all_committed and d.model.saved[0] < d.model.step:
            d.model.checkpoint()
            self.call("checkpoint", core.checkpoint, d.id, d.model.step, now, model=d.model.id)

    def commit(self, d: SimDrafter, now: float) -> None:
        model = d.model
        self.call("commit_step", self.core.commit_step, d.id, d.window, 0.001, now, model=model.id,
                  step=model.step + 1)
        model.train(d.window)
        d.window = []
        if model.step % self.o.checkpoint_every == 0:
            model.checkpoint()
            self.call("checkpoint", self.core.checkpoint, d.id, model.step, now, model=model.id)

    # -- the give-back storm -----------------------------------------------------------------
    def storm(self, now: float) -> dict[str, Any]:
        """A target and a drafter die holding jobs; another pair hangs past its leases."""
        core = self.core
        dead_t = next((t for t in self.targets if t.extracting), self.targets[0])
        held_t = len(dead_t.extracting)
        self.storm_call("deregister", core.deregister, dead_t.id, now, "dead")
        dead_t.id, dead_t.extracting = self.register("target", "target-replacement"), []
        dead_d = max(self.drafters, key=lambda d: (len(d.window) > 0, d.model.step - d.model.saved[0]))
        held_d, lost_steps = len(dead_d.window), dead_d.model.step - dead_d.model.saved[0]
        self.storm_call("deregister", core.deregister, dead_d.id, now, "dead")
        dead_d.model.crash()  # the process died: its model reloads the checkpoint, the ledger rolls back to it
        dead_d.window = []
        dead_d.id = self.register("drafter", f"drafter-{dead_d.model.id}", dead_d.model)
        hung_t = next(t for t in self.targets if t is not dead_t)
        hung_d = next(d for d in self.drafters if d is not dead_d)
        grant, _ = self.call("get_hs", core.get_hs, hung_d.id, now)
        if grant is not None and grant != DONE:
            hung_d.training = grant.job.job_id
        hung_t.hung_until = hung_d.hung_until = now + self.o.lease_s + 2 * SWEEP_INTERVAL_S
        self.hung_target = hung_t
        return {"dead_target_jobs": held_t, "dead_drafter_jobs": held_d, "rolled_back_steps": lost_steps,
                "hung_target_jobs": len(hung_t.extracting), "hung_drafter_jobs": int(hung_d.training is not None)}

    def end_hang(self, t: SimTarget) -> None:
        """The hung target finds its jobs refused and starts a new session (its slots were quarantined)."""
        self.storm_call("deregister", self.core.deregister, t.id, time.monotonic(), "left")
        t.id, t.extracting = self.register("target", "target-restarted"), []
        self.hung_target = None

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        o = self.o
        num_samples = samples_for_jobs(o.jobs)
        self.log(f"{num_samples} samples, building epoch 0 ...")
        lengths = np.asarray(synthetic_lengths(num_samples, BUCKETS, seed=o.seed), dtype=np.int64)
        start = time.monotonic()
        self.core = core = self.make_core(lengths)
        first_build_s = time.monotonic() - start
        full = o.jobs * o.epochs <= FULL_WITNESS_UP_TO
        self.targets = [SimTarget(self.register("target", f"target{i}"), []) for i in range(o.targets)]
        self.drafters = []
        for i in range(o.drafters):
            model = SimModel(f"model{i}", full=full)
            self.drafters.append(SimDrafter(self.register("drafter", f"drafter-{model.id}", model), model, []))
        self.hung_target: SimTarget | None = None
        jobs_per_epoch = core.epoch_jobs[0]
        storm_at = jobs_per_epoch * o.epochs * 9 // 20  # about halfway, between two checkpoints
        storm: dict[str, Any] | None = None
        self.giveback = LatencyHistogram()  # registrations before the storm are not give-backs
        epoch, epoch_start = 0, time.monotonic()
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        last_progress, last_count = time.monotonic(), 0
        self.watch_builds()
        run_start = time.monotonic()
        turn = 0
        while not core.done:
            now = time.monotonic()
            turn += 1  # who asks first changes every round, as requests arrive at the server in no fixed order
            for i in range(len(self.targets)):
                t = self.targets[(turn + i) % len(self.targets)]
                if t.hung_until <= now and not t.finished:
                    if t is self.hung_target:
                        self.end_hang(t)
                    self.target_turn(t, now)
            for i in range(len(self.drafters)):
                d = self.drafters[(turn + i) % len(self.drafters)]
                if d.hung_until <= now and not d.finished:
                    self.drafter_turn(d, now)
            if now >= next_sweep:
                sweep_start = time.perf_counter()
                given = sum(core.counters.given_back.values())
                self.call("sweep", core.sweep, now, lambda w: True)
                if sum(core.counters.given_back.values()) > given:
                    self.giveback.add(time.perf_counter() - sweep_start)
                self.call("maybe_snapshot", core.maybe_snapshot)
                core.journal.flush()
                # As the server's poll does: an undrained notification pipe fills after ~64k syncs and
                # then blocks the journal's thread (lines pile up in memory, close() never returns).
                core.journal.drain_notifications()
                next_sweep = now + SWEEP_INTERVAL_S
            while epoch < o.epochs and core.ledger.epoch_complete(epoch):
                self.rss_mb.append(self.process.memory_info().rss / 2**20)
                self.epoch_wall_s.append(time.monotonic() - epoch_start)
                self.log(f"epoch {epoch} committed in {self.epoch_wall_s[-1]:.1f} s, rss {self.rss_mb[-1]:.0f} MB")
                epoch, epoch_start = epoch + 1, time.monotonic()
            self.watch_builds()
            trained = sum(d.model.count for d in self.drafters)
            if storm is None and trained >= storm_at:
                storm = self.storm(now)
                self.log(f"give-back storm: {storm}")
            if trained != last_count:
                last_count, last_progress = trained, now
            elif now - last_progress > STALL_LIMIT_S:
                raise RuntimeError(f"no progress for {STALL_LIMIT_S:.0f} s: {core.ledger.counts_by_state()}, "
                                   f"pool {core.pool.counts()}")
        run_s = time.monotonic() - run_start
        witness = self.check_witness()
        given_back = dict(core.counters.given_back)
        self.call("maybe_snapshot", core.maybe_snapshot, force=True)
        core.close()
        core.journal.close()
        restart_s, restart_answer = self.time_restart(lengths)
        all_ops = LatencyHistogram()
        for hist in self.ops.values():
            all_ops.merge(hist)
        stall_kind = max(self.ops, key=lambda k: self.ops[k].max_s)
        return {
            "jobs_per_epoch": [int(core.epoch_jobs[e]) for e in sorted(core.epoch_jobs)], "samples": num_samples,
            "ops": all_ops.num_calls, "run_s": round(run_s, 2),
            "ops_per_s": round(all_ops.num_calls / run_s, 1),
            "op_p50_ms": round(all_ops.quantile(0.5) * 1e3, 4), "op_p99_ms": round(all_ops.quantile(0.99) * 1e3, 4),
            "stall_max_ms": round(all_ops.max_s * 1e3, 2), "stall_op": stall_kind,
            "giveback_max_ms": round(self.giveback.max_s * 1e3, 2),
            "restart_s": round(restart_s, 3), "restart_answer": restart_answer,
            "rss_mb": [round(r, 1) for r in self.rss_mb],
            "rss_growth": round(self.rss_mb[-1] / self.rss_mb[0], 3),
            "epoch_s": [round(s, 2) for s in self.epoch_wall_s],
            "epoch_build_s": [round(first_build_s, 2)] + [round(self.build_s[e], 2) for e in sorted(self.build_s)],
            "build_waits": self.build_waits, "storm": storm, "given_back": given_back, "refused": dict(self.refused),
            "per_op": {k: {"calls": h.num_calls, "p99_ms": round(h.quantile(0.99) * 1e3, 4),
                           "max_ms": round(h.max_s * 1e3, 2)} for k, h in sorted(self.ops.items())},
            **witness,
        }

    def check_witness(self) -> dict[str, Any]:
        """Exactly-once by the models' own record, against every job of every schedule."""
        models = [d.model for d in self.drafters]
        epoch_jobs = self.core.epoch_jobs
        num_jobs = sum(epoch_jobs.values())
        num_trained = sum(m.count for m in models)
        if all(m.trained is not None for m in models):
            counts = Counter(j for m in models for j in m.trained)
            expected = {make_job_id(e, i) for e, n in epoch_jobs.items() for i in range(n)}
            duplicates = sum(c - 1 for c in counts.values() if c > 1)
            missing = len(expected - counts.keys())
            unknown = len(counts.keys() - expected)
            return {"witness": "lists", "num_jobs": num_jobs, "num_trained": num_trained, "duplicates": duplicates,
                    "missing": missing, "exactly_once": duplicates == missing == unknown == 0}
        digest = 0
        for e, n in epoch_jobs.items():
            digest = (digest + int(mix64_array(make_job_id(e, 0) + np.arange(n, dtype=np.int64)).sum())) & MASK64
        trained_digest = sum(m.digest for m in models) & MASK64
        return {"witness": "digest", "num_jobs": num_jobs, "num_trained": num_trained,
                "exactly_once": num_trained == num_jobs and trained_digest == digest}

    def time_restart(self, lengths: np.ndarray) -> tuple[float, str]:
        """A new core on the same run directory (snapshot + journal replay), up to its first get_job answer."""
        start = time.monotonic()
        core = self.make_core(lengths)
        try:
            worker = core.register(role="target", name="target-after-restart", pid=1, host="bench", gpu=None,
                                   now=time.monotonic())
            answer = core.get_job(worker.id, time.monotonic())
            elapsed = time.monotonic() - start
        finally:
            core.close()
            core.journal.close()
        return elapsed, answer if isinstance(answer, str) else ("none" if answer is None else "job")


TARGETS = {"op_p99_ms": ("<=", 5.0), "stall_max_ms": ("<=", 200.0), "restart_s": ("<=", 10.0),
           "rss_growth": ("<=", 1.10)}


def format_result(result: dict[str, Any]) -> str:
    rows = [("jobs per epoch", ", ".join(map(str, result["jobs_per_epoch"]))), ("ops", result["ops"]),
            ("ops_per_s", result["ops_per_s"]), ("op_p50_ms", result["op_p50_ms"]),
            ("op_p99_ms", result["op_p99_ms"]), ("stall_max_ms", f"{result['stall_max_ms']} ({result['stall_op']})"),
            ("giveback_max_ms", result["giveback_max_ms"]), ("restart_s", result["restart_s"]),
            ("rss_mb", ", ".join(map(str, result["rss_mb"]))), ("rss_growth", result["rss_growth"]),
            ("epoch_s", ", ".join(map(str, result["epoch_s"]))),
            ("epoch_build_s", ", ".join(map(str, result["epoch_build_s"]))), ("build_waits", result["build_waits"]),
            ("exactly_once", f"{result['exactly_once']} ({result['witness']}, {result['num_trained']} trained of "
                             f"{result['num_jobs']})")]
    lines = []
    for name, value in rows:
        target = TARGETS.get(name)
        mark = ""
        if target is not None:
            mark = f"   target {target[0]} {target[1]}: " + ("ok" if result[name] <= target[1] else "MISSED")
        lines.append(f"{name:<16} {value}{mark}")
    lines.append("")
    lines.append(f"{'op':<16} {'calls':>10} {'p99_ms':>9} {'max_ms':>9}")
    for kind, stats in result["per_op"].items():
        lines.append(f"{kind:<16} {stats['calls']:>10} {stats['p99_ms']:>9.3f} {stats['max_ms']:>9.2f}")
    picks = result.get("pick_across_nodes") or []
    if picks:
        lines.append("")
        lines.append("pick across nodes (pool.transport=nixl: the reservoir per node, locality=prefer), mean of pick alone:")
        lines.extend(f"  {p['nodes']:>4} nodes, {p['ready']:>5} ready slots: {p['pick_us']:>7.1f} us a pick "
                     f"({p['served']} of {p['picks']} served)" for p in picks)
    return "\n".join(lines)


def run_dispatcher_load(options: DispatcherLoadOptions, *, as_json: bool) -> int:
    options.check()
    parent = options.dir or None
    if parent is not None and not os.path.isdir(parent):
        raise ValueError(f"--dir {parent} is not a directory")
    run_dir = tempfile.mkdtemp(prefix="hsd-bench-dispatcher-", dir=parent)
    pin_mmap_threshold()  # as the dispatcher process does
    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    load = DispatcherLoad(options, run_dir, log=log)
    try:
        result = load.run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    log("timing the pick across nodes (pool.transport=nixl's path)")
    result["pick_across_nodes"] = pick_section()
    result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result) if as_json else format_result(result))
    return 0 if result["exactly_once"] else 1
