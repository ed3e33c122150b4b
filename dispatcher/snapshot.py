"""The stats snapshot: what ``hsd stats``, the stats socket and /metrics show of a running dispatcher.

Built on the dispatcher's loop thread from the core's state; every figure is kept current by the
core and ledger, so a snapshot costs O(workers + models + buckets), not O(jobs): each worker's
held jobs are looked up once, and the drafters of a model found in the registry's index. The loop
builds it in steps (:func:`snapshot_steps`) for the stats socket and ``/metrics``, serving requests
between them: at thousands of workers, a snapshot at once would hold every request up for tens of ms.
"""

from __future__ import annotations

import time
from collections.abc import Generator

from common.run.records.lengths import NAMED_TOO_LONG
from common.wire.stats_figures import format_q_hsb
from common.wire.stats_snapshot import (CoreSnapshot, DroppedSamples, EpochView, GroupView, ModelView, RankView, StepCost,
                                          WaitingFor, WaitingModel, WorkerView)
from dispatcher.core import DispatcherCore
from dispatcher.core_types import Worker
from dispatcher.ledger import JobState
from dispatcher.step_balance import FEATURES


def worker_state(core: DispatcherCore, worker: Worker, holds: bool | None = None) -> str:
    """busy, idle, starved (waiting with nothing to do) or blocked (a target waiting for a free slot).
    ``holds``: whether it holds a job, when the caller looked already."""
    if worker.waiting_since is not None:
        return worker.wait_reason or "idle"
    if core.done:
        return "idle"
    if worker.role == "drafter" or (holds if holds is not None else bool(core.ledger.held_by(worker.id))):
        return "busy"
    return "idle"


def worker_view(core: DispatcherCore, w: Worker, now: float, holders: set[str]) -> WorkerView:
    """One worker as the snapshot shows it (its name goes into ``holders`` when it holds a job)."""
    alive_s = max(now - w.registered_at, 1e-9)
    waiting = w.total_wait_s + (now - w.waiting_since if w.waiting_since is not None else 0.0)
    held = [j.job_id for j in core.ledger.held_by(w.id)]
    if held:
        holders.add(w.name)
    return WorkerView(id=w.id, name=w.name, role=w.role, pid=w.pid, host=w.host, gpu=w.gpu,
                      state=worker_state(core, w, bool(held)), jobs=w.num_jobs,
                      tokens_per_s=round(w.num_tokens / alive_s, 1),
                      idle_ratio=round(min(1.0, waiting / alive_s), 3),
                      heartbeat_age_s=round(now - w.last_seen, 3),
                      alive_s=round(alive_s, 3), wait_s=round(waiting, 3),
                      held=held,
                      metrics=dict(w.metrics) if w.metrics else None,
                      gpu_health=w.gpu_health, slot_copies=w.slot_copies,
                      rank=w.group.rank if w.group else None,
                      membership=w.group.version if w.group else None,
                      tp_ranks=[RankView(rank=r, pid=pid, gpu=gpu) for r, pid, gpu in w.tp_ranks] or None)


def build_snapshot(core: DispatcherCore, now: float) -> CoreSnapshot:
    """The whole snapshot at once, as of ``now``."""
    holders: set[str] = set()
    workers = [worker_view(core, w, now, holders) for w in core.workers.values()]
    return assemble_snapshot(core, now, workers, holders)


def snapshot_steps(core: DispatcherCore, *, workers_a_step: int) -> Generator[None, None, CoreSnapshot]:
    """The snapshot built in steps, for a caller that serves requests between them (the loop's
    ``/metrics`` update): it yields after each ``workers_a_step`` workers' views, each group taken
    as of its own step, and returns the snapshot (the rest of it built in one more step). A worker that left meanwhile is still shown once;
    one that registered meanwhile is shown next time."""
    live = list(core.workers.values())
    holders: set[str] = set()
    workers: list[WorkerView] = []
    for start in range(0, len(live), workers_a_step):
        now = time.monotonic()
        workers += [worker_view(core, w, now, holders) for w in live[start:start + workers_a_step]]
        yield
    return assemble_snapshot(core, time.monotonic(), workers, holders)


def assemble_snapshot(core: DispatcherCore, now: float, workers: list[WorkerView], holders: set[str]) -> CoreSnapshot:
    """The snapshot around its workers' views: epochs, pool, models, groups, counters, waits."""
    epochs = []
    for epoch in sorted(core.ledger.epochs):
        progress = core.ledger.epochs[epoch]
        epochs.append(EpochView(epoch=epoch, jobs=progress.num_jobs, committed=progress.committed,
                                taken=sum(progress.taken.values()),
                                schedule_prefix_deviation=round(float(core.store.deviation[epoch]), 3),
                                consumed_prefix_deviation=round(progress.consumed_deviation.value, 3)))
    return CoreSnapshot(
        time=time.time(), uptime_s=round(now - core.started_at, 3), done=core.done,
        epochs_total=core.options.epochs, epochs=epochs, jobs_by_state=core.ledger.counts_by_state(),
        q_hsb={str(b): n for b, n in core.pool.ready_per_bucket().items()},  # msgpack map keys are str
        pool=core.pool.counts(), pool_peak_slots=core.pool.peak_in_use, workers=workers, steps=core.num_steps,
        models={m: ModelView(step=s, checkpoint=core.checkpoints.get(m, 0)) for m, s in core.ledger.model_step.items()},
        groups={m: group_view(core, g) for m, g in core.groups.groups.items()},
        membership_version=max(core.groups.versions().values()) if core.groups.groups else None,
        given_back=dict(core.counters.given_back), requests=dict(core.counters.requests),
        errors=dict(core.counters.errors), waiting_for=None if core.done else waiting_for(core, holders),
        step_mix=round(c.mixed_steps / c.steps, 4) if (c := core.counters).steps else None,
        dropped_samples=dropped_samples(core))


def dropped_samples(core: DispatcherCore) -> DroppedSamples | None:
    if not len(core.too_long):
        return None
    return DroppedSamples(count=len(core.too_long), first=core.too_long[:NAMED_TOO_LONG].tolist(),
                          longer_than=core.options.buckets[-1])


def waiting_for(core: DispatcherCore, holders: set[str] | None = None) -> WaitingFor:
    """What a run that is not done waits for: each open epoch's jobs by state (and who holds them),
    each model whose known checkpoint is behind its step (and whether a live drafter trains it),
    and one line a person reads for each. ``holders``: the names of the workers holding a job, when
    the caller gathered them already."""
    epochs, reasons = {}, []
    for epoch in sorted(core.epoch_jobs):
        if core.ledger.epoch_complete(epoch):
            continue
        states = {state.value: core.ledger.count(epoch, state) for state in JobState}
        epochs[str(epoch)] = {k: v for k, v in states.items() if v}
        reasons.append(f"epoch {epoch + 1}: " + ", ".join(f"{v} {k}" for k, v in epochs[str(epoch)].items()
                                                            if k != "committed"))
    if holders is None:
        holders = {worker.name for worker in core.workers.values() if core.ledger.held_by(worker.id)}
    else:
        holders = set(holders)
    if not epochs and len(core.epoch_jobs) < core.options.epochs:
        reasons.append(f"epoch {len(core.epoch_jobs) + 1} to be built")
    models = {}
    for model, step in sorted(core.ledger.model_step.items()):
        checkpoint = core.checkpoints.get(model, 0)
        if checkpoint >= step:
            continue
        live = sorted(w.name for w in core.registry.of_model(model))
        models[model] = WaitingModel(step=step, checkpoint=checkpoint, drafters=live)
        reasons.append(f"model {model} at step {step}, its known checkpoint at step {checkpoint}: "
                       + (f"waiting for {', '.join(live)} to checkpoint it" if live
                          else "no live drafter trains it (one must register, or a newer checkpoint be found on "
                               f"disk; once every job is committed and none has for {core.options.abandoned_model_s:g} "
                               "s, it goes back to "
                               + (f"its checkpoint at step {checkpoint}" if checkpoint
                                  else "step 0: it has no checkpoint")
                               + ", the jobs after it to pending)"))
        holders.update(live)
    return WaitingFor(epochs=epochs, models=models, workers=sorted(holders), reasons=reasons)


def group_view(core, group) -> GroupView:
    """A data-parallel group as a watcher sees it: its ranks, membership version, the ranks waiting
    to join, the steps it committed since its membership last changed, and how its steps are
    balanced (with cost: the fitted cost model's seconds per job, sequence and padded token)."""
    costs = core.step_costs.get(group.model)
    step_cost = None
    if costs is not None and costs.observations and group.spec.balance == "cost":
        step_cost = StepCost(**{name: float(w) for name, w in zip(FEATURES, costs.weights())},
                             observations=costs.observations)
    return GroupView(version=group.version, world_size=group.world_size, formed=group.formed,
                     step_balance=group.spec.balance, step_jobs=group.step_jobs if group.formed else 0,
                     step_cost=step_cost, members={str(r): w for w, r in group.members.items()},
                     waiting=len(group.waiting),
                     steps_since_change=max(0, core.ledger.model_step.get(group.model, 0) - group.opened_at_steps)
                     if group.formed else 0)


def progress_line(core: DispatcherCore, epochs: int) -> str:
    """The dispatcher's progress line: the open epoch, steps, ready slots per bucket, workers, groups."""
    open_epochs = [e for e in sorted(core.epoch_jobs) if not core.ledger.epoch_complete(e)] or [max(core.epoch_jobs)]
    progress = core.ledger.epochs[open_epochs[0]]
    states = [worker_state(core, w) for w in core.workers.values()]
    groups = "".join(f", group {m} {g.world_size} rank(s) membership {g.version} {len(g.waiting)} waiting "
                     f"{core.ledger.model_step.get(m, 0) - g.opened_at_steps if g.formed else 0} steps since change"
                     for m, g in core.groups.groups.items())
    workers = " ".join(f"{state}={states.count(state)}" for state in sorted(set(states))) or "none"
    return (f"epoch {open_epochs[0] + 1}/{epochs}: {progress.committed}/{progress.num_jobs} jobs committed, "
            f"{core.num_steps} steps, ready per bucket {format_q_hsb(core.pool.ready_per_bucket())}, "
            f"workers {workers}{groups}")
