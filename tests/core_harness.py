"""Driving DispatcherCore by hand (no sockets) for the core's tests: small epochs, a turn-based sim."""

from __future__ import annotations

import random
from collections import Counter

from common.run.records.job_ids import make_job_id
from common.wire.messages import ModelClaim
from dispatcher.core import DispatcherCore
from dispatcher.core_types import DONE, CoreOptions
from dispatcher.journal import Journal
from dispatcher.ledger import JobState
from dispatcher.pool import HSPool

BUCKETS = [64, 128, 256]
TOKENS = 512                          # batch sizes 8, 4, 2


def small_lengths(seed=0, scale=1):
    """24 + 16 + 10 samples -> 3 + 4 + 5 = 12 jobs per epoch (times ``scale``)."""
    rng = random.Random(seed)
    lengths = ([rng.randint(1, 64) for _ in range(24 * scale)] + [rng.randint(65, 128) for _ in range(16 * scale)]
               + [rng.randint(129, 256) for _ in range(10 * scale)])
    rng.shuffle(lengths)
    return lengths


def make_core(run_dir, *, lengths=None, epochs=2, shared_slots=6, min_ready=2, credits=2, lease_s=1000.0,
              worker_timeout_s=1e6, now=0.0):
    options = CoreOptions(lease_s=lease_s, worker_timeout_s=worker_timeout_s, epochs=epochs, run_seed=3,
                          buckets=list(BUCKETS), tokens_per_batch=TOKENS, order="interleave")
    pool = HSPool(min_ready=min_ready, target_credits=credits, pull="deficit", seed=1, num_buckets=len(BUCKETS))
    return DispatcherCore(options, run_dir=run_dir, lengths=small_lengths() if lengths is None else lengths,
                          journal=Journal(run_dir), pool=pool, shared_slots=shared_slots, now=now)


def register(core, role, n, now=0.0):
    return [core.register(role=role, name=f"{role}{i}", pid=1000 + i, host="h", gpu=None, now=now).id
            for i in range(n)]


class Sim:
    """Targets and drafters taking turns; every decision goes through the core's methods."""

    def __init__(self, core, targets, drafters, *, accum=2, checkpointed=True):
        self.core, self.targets, self.drafters, self.accum = core, targets, drafters, accum
        self.checkpointed = checkpointed
        self.extracting = {t: [] for t in targets}
        self.window = {d: [] for d in drafters}
        self.commits = []          # (step, drafter, job ids)
        self.now = 1.0
        self.finished = set()

    def round(self):
        core = self.core
        self.now += 1.0
        for t in self.targets:
            for grant in self.extracting[t]:
                core.job_ready(t, grant.job.job_id, grant.job.generation, 0.01, self.now)
            self.extracting[t] = []
            while True:
                grant = core.get_job(t, self.now)
                if grant is None:
                    break
                if grant == DONE:
                    self.finished.add(t)
                    break
                assert grant.job.state is JobState.EXTRACTING and grant.job.holder == t
                assert grant.lengths == [int(core.lengths[s]) for s in grant.samples]
                self.extracting[t].append(grant)
        for d in self.drafters:
            ready_before = core.pool.num_ready
            grant, flush = core.get_hs(d, self.now)
            if grant == DONE:
                assert flush is False
                self.finished.add(d)
                continue
            if grant is not None:
                job = grant.job
                pending = core.ledger.count(job.epoch, JobState.PENDING)
                # the min-ready reservoir: below it only while the epoch's tail drains
                assert ready_before >= core.pool.min_ready or pending == 0
                # epochs are consumed in order
                for e in core.epoch_jobs:
                    if e < job.epoch:
                        assert core.ledger.count(e, JobState.PENDING, JobState.EXTRACTING, JobState.READY) == 0
                assert job.state is JobState.TRAINING and job.holder == d
                core.consumed(d, job.job_id, self.now)
                self.window[d].append(job.job_id)
            if self.window[d] and (len(self.window[d]) == self.accum or flush):
                step = core.commit_step(d, self.window[d], 0.01, self.now)
                if self.checkpointed:
                    core.checkpoint(d, step, self.now)
                self.commits.append((step, d, list(self.window[d])))
                self.window[d] = []

    def run(self, until=lambda sim: False, max_rounds=500):
        for _ in range(max_rounds):
            if self.core.done or until(self):
                return
            self.round()

    def committed_ids(self):
        return [j for _, _, jobs in self.commits for j in jobs]


def all_job_ids(core):
    return {make_job_id(e, i) for e, n in core.epoch_jobs.items() for i in range(n)}


# -- a whole run ----------------------------------------------------------------------------------


class Model:
    """A drafter's model state as the core's tests see it: its step and its witness, live and checkpointed."""

    def __init__(self, model_id):
        self.id = model_id
        self.step, self.trained = 0, []
        self.ckpt_step, self.ckpt_trained = 0, []

    def checkpoint(self):
        self.ckpt_step, self.ckpt_trained = self.step, list(self.trained)

    def crash(self):
        """The process died: the state reloaded is the checkpoint's."""
        self.step, self.trained = self.ckpt_step, list(self.ckpt_trained)


class ModelSim(Sim):
    """Sim whose drafters train named models with commit-then-apply and checkpoint every ``every`` steps."""

    def __init__(self, core, targets, drafter_models, *, accum=2, every=1, last_checkpoint=True):
        self.models = drafter_models  # drafter id -> Model
        super().__init__(core, targets, list(drafter_models), accum=accum, checkpointed=False)
        self.every = every
        self.last_checkpoint = last_checkpoint  # False: the last steps' checkpoints never reach the core

    def round(self):
        core = self.core
        real_commit = core.commit_step

        def commit(d, job_ids, busy_s, now):
            model = self.models[d]
            step = real_commit(d, job_ids, busy_s, now, model=model.id, step=model.step + 1)
            model.step, model.trained = step, model.trained + list(job_ids)
            if self.every and model.step % self.every == 0:
                model.checkpoint()
                core.checkpoint(d, model.step, now, model=model.id)
            return step

        core.commit_step = commit
        try:
            super().round()
            for d, model in self.models.items():  # nothing more coming: checkpoint what is left
                if d not in self.finished and not self.window[d] and model.step > model.ckpt_step \
                        and core.all_committed and self.last_checkpoint:
                    model.checkpoint()
                    core.checkpoint(d, model.step, self.now, model=model.id)
        finally:
            del core.commit_step


def register_models(core, models, now=0.0):
    """Register one drafter per model, each with the step of the state it holds."""
    return {core.register(role="drafter", name=f"drafter-{m.id}", pid=2000 + i, host="h", gpu=None, now=now,
                          model=ModelClaim(id=m.id, step=m.step)).id: m for i, m in enumerate(models)}


def witness_counts(models):
    counts = Counter()
    for m in models:
        counts.update(m.trained)
    return counts
