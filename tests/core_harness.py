"""Driving DispatcherCore by hand (no sockets) for the core's tests: small epochs, a turn-based sim."""

from __future__ import annotations

import random

from dispatcher.core import DONE, CoreOptions, DispatcherCore
from dispatcher.journal import Journal
from dispatcher.ledger import JobState, make_job_id
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
    pool = HSPool(min_ready=min_ready, target_credits=credits, pull="deficit", seed=1)
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
                assert grant.lengths == [core.lengths[s] for s in grant.job.samples]
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
                for e in core.schedules:
                    if e < job.epoch:
                        assert core.ledger.count(e, JobState.PENDING, JobState.EXTRACTING, JobState.READY) == 0
                assert job.state is JobState.TRAINING and job.holder == d
                core.consumed(d, job.job_id, self.now)
                self.window[d].append(job.job_id)
            if self.window[d] and (len(self.window[d]) == self.accum or flush):
                step = core.commit_step(d, self.window[d], 0.01, self.checkpointed, self.now)
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
    return {make_job_id(e, i) for e, s in core.schedules.items() for i in range(len(s.batches))}


# -- a whole run ----------------------------------------------------------------------------------
