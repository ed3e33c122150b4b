"""``hsd report``: what a run did, read back from its journal and persisted schedules.

Exactly-once (every scheduled job in exactly one committed step), fairness of the schedule and of
the consumed stream, step mix, per-stage utilization and throughput, and the samples no epoch
trained (longer than the last bucket).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from common.run.checkpoint_manifest import DamagedCheckpoint
from common.run.records.events import (DispatcherStarted, DispatcherStopped, EpochCommitted, EpochStarted, Event,
                                       JobConsumed, JobGivenBack, JobReady, ModelRolledBack, StepCommitted,
                                       WorkerJoined, WorkerLeft)
from common.run.records.fairness import prefix_deviation_array, tail_skew
from common.run.records.job_ids import split_job_id
from common.run.records.journal import read_journal
from common.run.records.lengths import NAMED_TOO_LONG, too_long_samples
from common.run.records.rundir import read_run_lengths
from common.run.records.schedule import EpochSchedule, load_schedule
from common.run.witness import list_models, verified_latest

STAGES = ("target", "drafter")


def witness(run_dir: Path, epoch_jobs: dict[int, int]) -> dict[str, Any]:
    """Judge exactly-once by the models' own records, never by the ledger: every job of ``epoch_jobs``
    must appear exactly once over the latest checkpoints of every model."""
    records = [_final_witness(run_dir, model) for model in list_models(run_dir)]
    ids = np.concatenate([np.frombuffer(r.to_bytes(), dtype="<u8") for r in records]) if records else np.zeros(0, "<u8")
    unique, counts = np.unique(ids, return_counts=True)
    duplicates = int((counts - 1).sum())
    missing = 0
    for epoch, num_jobs in epoch_jobs.items():
        expected = np.arange(num_jobs, dtype=np.uint64) + np.uint64(epoch * 1_000_000_000)
        missing += int(num_jobs - np.isin(expected, unique, assume_unique=True).sum())
    return {"witness_models": len(records), "witness_trained": int(len(ids)),
            "witness_duplicates": duplicates, "witness_missing": missing}


def _final_witness(run_dir: Path, model: str):
    try:
        return verified_latest(run_dir, model).trained_jobs()
    except DamagedCheckpoint as exc:
        raise DamagedCheckpoint(exc.path, f"{exc.problem}: the latest checkpoint of model {model} is damaged, so "
                                          f"what it trained cannot be judged; restore the file from a copy") from None


class _ReportPass:
    """One streaming pass over the journal: what the report needs, never the whole list of events.

    Memory grows with the live state (the commits the ledger still holds, one int per scheduled
    job for the consumed order), not with the number of events."""

    def __init__(self) -> None:
        self.first_t: float | None = None
        self.last_t = 0.0
        self.damaged: list[tuple[Path, int, str]] = []  # damaged progress records passed over (file, line, kind)
        self.epoch_jobs: dict[int, int] = {}
        self.epochs_committed: set[int] = set()
        self.commits: dict[str, list[StepCommitted]] = defaultdict(list)  # model -> its live commits, in order
        self.consumed_at: dict[int, np.ndarray] = {}  # epoch -> position of each job's last consumed event
        self.num_consumed = 0
        self.reads: Counter = Counter()  # "local" | "remote" -> slots read (nixl runs mark the remote ones)
        self.joined: dict[str, tuple[str, float]] = {}
        self.worker_names: dict[str, set[str]] = defaultdict(set)  # role -> names that ever joined
        self.alive: Counter = Counter()
        self.busy_target = 0.0
        self.tokens_target = 0
        self.given_back: Counter = Counter()
        self.num_starts = 0
        self.stopped_done = False

    def add(self, e: Event) -> None:
        t = e.t
        if self.first_t is None:
            self.first_t = t
        self.last_t = t
        if isinstance(e, StepCommitted):
            e.metrics = None  # not reported; the commits of a long run are many
            self.commits[e.model or e.w].append(e)
        elif isinstance(e, ModelRolledBack):
            self.commits[e.model] = [c for c in self.commits[e.model] if c.step <= e.step]
        elif isinstance(e, JobConsumed):
            epoch, index = split_job_id(e.job)
            positions = self.consumed_at.get(epoch)
            if positions is not None and index < len(positions):
                positions[index] = self.num_consumed
            self.num_consumed += 1
            self.reads["remote" if e.remote else "local"] += 1
        elif isinstance(e, JobReady):
            self.busy_target += e.busy_s
            self.tokens_target += e.tokens
        elif isinstance(e, EpochStarted):
            if e.epoch not in self.epoch_jobs:
                self.epoch_jobs[e.epoch] = e.jobs
                self.consumed_at[e.epoch] = np.full(e.jobs, -1, dtype=np.int64)
        elif isinstance(e, EpochCommitted):
            self.epochs_committed.add(e.epoch)
        elif isinstance(e, JobGivenBack):
            self.given_back[e.reason.split(":")[0]] += 1
        elif isinstance(e, WorkerJoined):
            self.joined[e.w] = (e.role, t)
            self.worker_names[e.role].add(e.name or e.w)
        elif isinstance(e, WorkerLeft) and e.w in self.joined:
            role, since = self.joined.pop(e.w)
            self.alive[role] += t - since
        elif isinstance(e, (DispatcherStarted, DispatcherStopped)):  # a dispatcher restart forgets every worker
            for role, since in self.joined.values():
                self.alive[role] += t - since
            self.joined.clear()
            if isinstance(e, DispatcherStarted):
                self.num_starts += 1
            elif e.done:
                self.stopped_done = True

    def close(self) -> None:
        for role, since in self.joined.values():
            self.alive[role] += self.last_t - since
        self.joined.clear()


def read_run(run_dir: str | os.PathLike) -> _ReportPass:
    """One pass over a run's journal (every segment)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    run = _ReportPass()
    for event in read_journal(run_dir, damaged=run.damaged):
        run.add(event)
    if run.first_t is None:
        raise FileNotFoundError(f"{run_dir} holds no journal: is it a run directory?")
    run.close()
    return run


def dropped_samples(run_dir: Path, schedules: dict[int, EpochSchedule | None]) -> dict[str, Any]:
    """The samples longer than the schedules' last bucket, from the lengths the run's schedules were built from."""
    schedule = next((s for s in schedules.values() if s is not None), None)
    lengths = read_run_lengths(run_dir)
    if schedule is None or lengths is None:
        return {"count": 0, "first": [], "longer_than": 0}
    longer_than = schedule.buckets[-1].max_len
    too_long = too_long_samples(lengths, [longer_than])
    return {"count": len(too_long), "first": too_long[:NAMED_TOO_LONG].tolist(), "longer_than": longer_than}


def dropped_line(count: int, first: list[int], longer_than: int) -> str:
    """Samples no epoch trains (longer than the last bucket): ``hsd stats`` and ``hsd report`` alike."""
    more = ", ..." if count > len(first) else ""
    return (f"dropped   {count} sample(s) longer than the last bucket ({longer_than}), in no epoch: sample "
            f"{', '.join(map(str, first))}{more}")


def build_report(run_dir: str | os.PathLike) -> dict[str, Any]:
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    epochs = sorted(run.epoch_jobs)
    schedules = {epoch: load_schedule(run_dir, epoch) for epoch in epochs}
    jobs_total = sum(s.num_jobs for s in schedules.values() if s is not None)
    commits = [c for model_commits in run.commits.values() for c in model_commits]
    num_committed_entries = sum(len(c.jobs) for c in commits)
    committed_per_epoch: Counter = Counter()
    distinct: set[int] = set()
    for c in commits:
        for job in c.jobs:
            if job not in distinct:
                distinct.add(job)
                committed_per_epoch[split_job_id(job)[0]] += 1

    # step_mix: the step took a new bucket at every pull where an eligible new one was ready, i.e. it
    # covers min(accum, buckets available) with availability judged at each pull. The stricter
    # step_mix_at_open judges it once, when the step's window opened (other drafters may take those).
    mixed = sum(1 for c in commits if c.mixed)
    mixed_at_open = sum(1 for c in commits if len(c.buckets) >= min(len(c.jobs), c.avail or 0))

    per_epoch = []
    for epoch, schedule in schedules.items():
        if schedule is None:
            continue
        totals = schedule.bucket_totals
        positions = run.consumed_at[epoch]
        taken = np.flatnonzero(positions >= 0)
        stream = np.asarray(schedule.job_bucket)[taken[np.argsort(positions[taken], kind="stable")]]
        figures = schedule.saved_figures or schedule.figures()
        per_epoch.append({"epoch": epoch, "jobs": schedule.num_jobs, "committed": committed_per_epoch[epoch],
                          "schedule_prefix_deviation": round(figures["prefix_deviation"], 3),
                          "consumed_prefix_deviation": round(prefix_deviation_array(stream, totals), 3),
                          "schedule_tail_skew": round(figures["tail_skew"], 4),
                          "consumed_tail_skew": round(tail_skew(stream.tolist(), dict(totals)), 4)})

    wall_s = max(run.last_t - run.first_t, 1e-9)
    alive = dict(run.alive)
    busy = {"target": run.busy_target, "drafter": sum(c.busy_s for c in commits)}
    tokens = {"target": run.tokens_target, "drafter": sum(c.tokens for c in commits)}
    stages = {}
    for stage in STAGES:
        capacity = tokens[stage] / busy[stage] * alive.get(stage, 0.0) / wall_s if busy[stage] else 0.0
        stages[stage] = {"utilization": round(busy[stage] / alive[stage], 4) if alive.get(stage) else 0.0,
                         "tokens_per_s": round(tokens[stage] / wall_s, 1),
                         "capacity_tokens_per_s": round(capacity, 1)}
    slower = min((s["capacity_tokens_per_s"] for s in stages.values() if s["capacity_tokens_per_s"]), default=0.0)
    epochs_committed = run.epochs_committed
    finished = bool(epochs) and all(e in epochs_committed for e in epochs) and run.stopped_done
    scope = {e: schedules[e].num_jobs for e in epochs if schedules.get(e) is not None
             and (finished or e in epochs_committed)}
    return {
        **witness(run_dir, scope),
        "run_dir": str(run_dir),
        "finished": finished,
        "epochs": len(epochs),
        "jobs_total": jobs_total,
        "committed": len(distinct),
        "duplicates": num_committed_entries - len(distinct),
        # A finished run that misses a job lost it; an unfinished one has it still to do.
        "lost": jobs_total - len(distinct) if finished else 0,
        "uncommitted": jobs_total - len(distinct),
        "slots_verified": sum(c.verified for c in commits),
        "damaged_records": [f"{path.name}:{line} ({kind})" for path, line, kind in run.damaged],
        "given_back": dict(run.given_back),
        "steps": len(commits),
        "step_mix": round(mixed / len(commits), 4) if commits else 0.0,
        "step_mix_at_open": round(mixed_at_open / len(commits), 4) if commits else 0.0,
        "mean_buckets_per_step": round(sum(len(c.buckets) for c in commits) / len(commits), 3) if commits else 0.0,
        "prefix_deviation": {"schedule": max((p["schedule_prefix_deviation"] for p in per_epoch), default=0.0),
                             "consumed": max((p["consumed_prefix_deviation"] for p in per_epoch), default=0.0)},
        "tail_skew": {"schedule": max((p["schedule_tail_skew"] for p in per_epoch), default=0.0),
                      "consumed": max((p["consumed_tail_skew"] for p in per_epoch), default=0.0)},
        "per_epoch": per_epoch,
        "wall_s": round(wall_s, 3),
        "stages": stages,
        "pipeline_efficiency": round(stages["drafter"]["tokens_per_s"] / slower, 4) if slower else 0.0,
        "restarts": run.num_starts - 1,
        "reads": {"local": run.reads["local"], "remote": run.reads["remote"]},
        "dropped_samples": dropped_samples(run_dir, schedules),
        **_group_figures(commits),
    }


def _group_figures(commits: list[StepCommitted]) -> dict[str, Any]:
    """Data-parallel steps: how long rank 0 waited at the gradient all-reduce, as a share of its steps."""
    group_steps = [c for c in commits if c.membership is not None]
    if not group_steps:
        return {}
    wait_s = sum(c.sync_wait_s for c in group_steps)
    step_s = sum(c.step_s for c in group_steps)
    # every rank's wait for the step's slowest rank: its compute time short of the slowest's
    measured = [c for c in group_steps if len(c.rank_busy_s) > 1]
    behind_s = sum(max(c.rank_busy_s) - b for c in measured for b in c.rank_busy_s)
    rank_s = sum(len(c.rank_busy_s) * c.step_s for c in measured)
    return {"group_steps": len(group_steps), "allreduce_wait_s": round(wait_s, 3),
            "allreduce_wait_share": round(wait_s / step_s, 4) if step_s else 0.0,
            "rank_wait_share": round(behind_s / rank_s, 4) if rank_s else 0.0,
            "memberships": len({c.membership for c in group_steps})}


# Below this utilization for both stages the report says that neither stage's compute set the pace
# (the pipeline efficiency, about the slower stage's utilization, is then below it too): a simulated run on
# a small host, where the bytes moved cost more than the modeled compute, reads so.
IDLE_BELOW = 0.75


def idle_pipeline(report: dict[str, Any]) -> bool:
    """Whether both stages idled most of the run."""
    stages = report["stages"].values()
    return bool(stages) and all(0 < s["utilization"] < IDLE_BELOW for s in stages)


def format_report(report: dict[str, Any]) -> str:
    lines = [f"run {report['run_dir']}: {'finished' if report['finished'] else 'NOT finished'}, "
             f"{report['epochs']} epoch(s), {report['wall_s']:.1f}s, {report['restarts']} dispatcher restart(s)",
             f"jobs      total {report['jobs_total']}  committed {report['committed']}  "
             f"duplicates {report['duplicates']}  lost {report['lost']}  still to do {report['uncommitted']}  "
             f"given back {report['given_back'] or 0}  "
             f"slots verified {report['slots_verified']}",
             f"witness   {report['witness_models']} model(s) trained on {report['witness_trained']} jobs: "
             f"duplicates {report['witness_duplicates']}  missing {report['witness_missing']} "
             f"(judged by the models' own records)",
             f"steps     {report['steps']}  step_mix {report['step_mix']:.3f} (at window open "
             f"{report['step_mix_at_open']:.3f}, {report['mean_buckets_per_step']:.2f} buckets per step)",
             f"fairness  prefix deviation schedule {report['prefix_deviation']['schedule']:.2f} / consumed "
             f"{report['prefix_deviation']['consumed']:.2f} batches; tail skew schedule "
             f"{report['tail_skew']['schedule']:.3f} / consumed {report['tail_skew']['consumed']:.3f}"]
    if report.get("damaged_records"):
        damaged = report["damaged_records"]
        lines.append(f"damaged   {len(damaged)} progress record(s) passed over, none a commit: {', '.join(damaged[:5])}"
                     + (" ..." if len(damaged) > 5 else "") + " (the figures of utilization may read low)")
    for stage, s in report["stages"].items():
        lines.append(f"{stage:<9} utilization {s['utilization']:.1%}  {s['tokens_per_s']:,.0f} tok/s "
                     f"(capacity {s['capacity_tokens_per_s']:,.0f} tok/s)")
    lines.append(f"pipeline efficiency {report['pipeline_efficiency']:.1%}")
    if idle_pipeline(report):
        lines.append(f"          neither stage was busy {IDLE_BELOW:.0%} of its time: what set the pace was not their "
                     f"compute (the host's CPUs, the pool's slots, the control plane, or a run too short for its start)")
    dropped = report.get("dropped_samples") or {}
    if dropped.get("count"):
        lines.append(dropped_line(dropped["count"], dropped["first"], dropped["longer_than"]))
    reads = report.get("reads") or {}
    if reads.get("remote"):
        total = reads["local"] + reads["remote"]
        lines.append(f"reads     local {reads['local']}  remote {reads['remote']} (from another node's slots, "
                     f"{reads['remote'] / total:.1%})")
    if report.get("group_steps"):
        lines.append(f"group     {report['group_steps']} data-parallel steps over {report['memberships']} "
                     f"membership(s); rank 0 waited {report['allreduce_wait_s']:.1f}s at the all-reduce "
                     f"({report['allreduce_wait_share']:.1%} of its step time); the ranks waited for the "
                     f"step's slowest {report['rank_wait_share']:.1%} of their step time")
    return "\n".join(lines)
