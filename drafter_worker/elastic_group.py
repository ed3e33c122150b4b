"""A rank of an elastic data-parallel group: the step group of a drafter that trains with peers.

Drafters that register the same model as ranks of a group (:mod:`dispatcher.groups`) train it
together, in the one drafter loop (:mod:`drafter_worker.loop`); this is the part that is the
group's. A rank registers, then asks ``join_group`` for the membership version that names it: its
rank, the world size, the store of the version's rendezvous (a FileStore path, or across nodes
rank 0's TCPStore: :mod:`drafter_worker.rendezvous`), the version's step, and whether a state
transfer comes first. The ranks open a ``torch.distributed`` group on it
(:mod:`drafter_worker.process_group`); a rank waiting at the rendezvous asks the dispatcher every
quarter second whether its version still stands, so it never waits out a timeout for a version
nobody else will join.

**State comes from a live rank.** When some rank of the version holds another step than the
version's (a joiner), rank 0 — a survivor holding the committed step — broadcasts its whole state
(:mod:`drafter_worker.state_transfer`); every rank checks the step and the weights' checksum before
the first step. Survivors keep their in-memory state: a membership change never goes back to a
checkpoint.

A step, in the order every rank keeps:

1. each rank pulls and trains on its own micro-batches (``get_hs`` naming its version; the
   dispatcher's accumulation window spans the whole group, so lengths mix across ranks), and reports
   them ``consumed``;
2. once it holds its share of the step, or the dispatcher says ``flush``/``done``, or it was asked
   to stop, it enters the **round**. A step has ``accum_steps x count`` micro-batches
   (``drafter.elastic_batch=tokens``) or ``accum_steps`` per rank (``ranks``); with
   ``drafter.step_balance=cost`` the dispatcher says when a rank holds its share of the step's
   estimated cost (``step_full``), with ``count`` each rank takes an even count. In the round the
   ranks exchange their job ids and flags as fixed-size int64 rows (no pickle), then all-reduce the
   gradients (the backend's ``sync_gradients``);
3. rank 0 alone commits the step, naming every rank's jobs, and broadcasts the outcome and whether
   a new version opened at this step boundary (ranks waiting to join); only then does every rank
   apply the step (commit, then apply) or drop it;
4. a new version, or a rank that said it is leaving, ends this version after the step: every rank
   closes the group and asks for the next version. A rank asked to stop (SIGTERM) leaves then.

Failure: a dead rank makes the others' collectives fail (gloo sees the closed socket); one that
is only stopped closes nothing, so every rank also leaves a collective as soon as the dispatcher
declared a peer dead (its heartbeat's answer names no version any more: about a heartbeat after
``dispatcher.worker_timeout_s``), and ``drafter.collective_timeout_s`` bounds the rest. The step
commits nothing; every survivor drops it and
asks for the next version saying its version failed, which ends it at once; the dispatcher opens
the next one with the ranks still alive, and they carry on from their own weights. When rank 0 dies
with its outcome unsent, the others ask the dispatcher (``step_outcome``) whether the step
committed. A rank that finds no version to train in within ``drafter.group_wait_s`` (too few ranks
for ``drafter.min_ranks``, or for ``drafter.count`` in a new group) leaves and exits with an error
(:class:`drafter_worker.step_group.GroupNeverFormed`).

The time from a rank's local gradients being ready to the all-reduce completing (the wait for the
slowest rank plus the exchange itself) is logged per step with its share of the step's wall time.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import msgspec
import psutil
import torch

from common import faults
from common.run.config import DrafterSection
from common.wire import messages
from common.wire.messages import ErrorCode, ProtocolError
from common.worker.backends import DrafterBackend
from common.worker.gpu_health import ReportingSession
from common.worker.runtime import CALL_TIMEOUT_S, DispatcherGone, NoReply, WorkerLost
from drafter_worker.busy_clock import BusyClock
from drafter_worker.checkpointing import Checkpoints
from drafter_worker.process_group import CollectiveFailed, RendezvousIncomplete, StepGroup, VersionEnded
from drafter_worker.rendezvous import RendezvousServer
from drafter_worker.state_transfer import StateTransferFailed, receive_state, send_state
from drafter_worker.step_group import (ABORTED, COMMITTED, NEXT_VERSION, PENDING, DrafterState, GroupNeverFormed,
                                       RankRound, RoundEnd)

log = logging.getLogger("hsd.drafter")

JOIN_POLL_MS = 1000


class ElasticGroup:
    def __init__(self, section: DrafterSection, *, name: str, session: ReportingSession, backend: DrafterBackend,
                 state: DrafterState, clock: BusyClock, checkpoints: Checkpoints, stopping: Callable[[], bool],
                 rendezvous: str, control_endpoint: str):
        """``section``: the drafter's; ``rendezvous``: file or tcp (the run's, resolved), the store of a
        tcp one found towards ``control_endpoint``; ``stopping``: whether this rank was asked to stop."""
        if not section.grouped:
            raise ValueError("a data-parallel drafter needs drafter.data_parallel=true and drafter.count > 1 "
                             "or drafter.max_ranks > 1")
        self.section, self.name, self.session, self.backend = section, name, session, backend
        self.state, self.clock, self.checkpoints, self.stopping = state, clock, checkpoints, stopping
        self.spec = messages.GroupClaim(size=section.group_size, min_ranks=section.min_ranks,
                                        max_ranks=section.max_ranks, balance=section.step_balance,
                                        accum_steps=section.accum_steps, elastic_batch=section.elastic_batch)
        self.timeout_s = section.collective_timeout_s
        self.group_wait_s = section.group_wait_s
        # drafter.rendezvous=tcp: the store this rank hosts for the versions whose rank 0 it is
        self.rendezvous = (RendezvousServer.for_rank(section, control_endpoint=control_endpoint)
                           if rendezvous == "tcp" else None)
        self.group: StepGroup | None = None
        self.membership: messages.Membership | None = None  # the version this rank trains in
        self.rank, self.world_size = -1, 0
        self._after, self._failed, self._waiting_since = 0, False, time.monotonic()
        self._round_seq = 0  # rounds of the current version
        self._rank_jobs: dict[int, list[list[int]]] = {}  # rank 0: each rank's job ids of the latest rounds
        self.num_versions = 0
        self.num_applied = 0  # steps this process applied (its first one is logged with its start-up time)
        self.sync_wait_s = 0.0  # summed over applied steps
        self.step_wall_s = 0.0
        self._step_started = time.perf_counter()
        self._log_checksums = faults.log_weight_checksums()  # test-only: the weights' CRC32 logged per step

    @property
    def version(self) -> int:
        return self.membership.membership if self.membership is not None else 0

    @property
    def sync_wait_share(self) -> float:
        return self.sync_wait_s / self.step_wall_s if self.step_wall_s > 0 else 0.0

    # -- membership -----------------------------------------------------------------------------
    def group_claim(self) -> messages.GroupClaim:
        if self.rendezvous is None:
            return self.spec
        return msgspec.structs.replace(self.spec, store=self.rendezvous.address)

    def poll_membership(self) -> int:
        # a poll names its version: one sent before a change is answered group_changed
        return self.version

    @staticmethod
    def registered(reply: messages.RegisterReply) -> None:
        """A rank's step matters only when its version opens (a live rank's state may replace it)."""

    def start(self, registration: messages.RegisterReply) -> None:
        self._after, self._failed, self._waiting_since = 0, False, time.monotonic()

    def run_version(self, train: Callable[[], str]) -> str:
        """Join the next version, open its group (taking the state when it says so), train in it."""
        self.membership = self._join_group(after=self._after, failed=self._failed, started=self._waiting_since)
        version = self.version
        self.rank, self.world_size = self.membership.rank, self.membership.world_size
        self.state.accum = self.section.rank_accum_steps(rank=self.rank, world_size=self.world_size)
        self.session.held.clear()  # what the last version held went back when it ended
        self.num_versions += 1
        try:
            self.group = self._open_group(self._waiting_since)
            self._waiting_since = time.monotonic()
            if self.membership.transfer:
                self._transfer()
            self.clock.reset()  # rounds are counted per version: every rank of it counts the same ones
            self._round_seq, self._rank_jobs = 0, {}
            self._step_started = time.perf_counter()
            ended = train()
            self._failed = False
        except CollectiveFailed as exc:
            log.warning("%s: membership %d failed: %s", self.name, version, exc)
            ended, self._failed = NEXT_VERSION, True
        except StateTransferFailed as exc:
            # the state it holds may be half loaded: back to its checkpoint, then in line as a joiner
            log.warning("%s: membership %d: the state transfer failed (%s); registering again", self.name,
                        version, exc)
            self.close()
            if self.rank != self.membership.source:
                self.checkpoints.reload()
            raise WorkerLost(f"state transfer of membership {version} failed") from None
        except ProtocolError as exc:
            if exc.code != ErrorCode.GROUP_CHANGED:
                raise
            log.info("%s: membership %d ended: %s", self.name, version, exc.message)
            ended, self._failed = NEXT_VERSION, False
        finally:
            self.close()
        self._after = version
        return ended

    def _join_group(self, *, after: int, failed: bool, started: float) -> messages.Membership:
        """The next version that names this rank, asked for until ``drafter.group_wait_s`` is spent."""
        while True:
            if self.stopping():
                raise WorkerLost("asked to stop while waiting for a membership")
            reply = self.session.call(messages.JoinGroup(wait_ms=JOIN_POLL_MS, after=after, step=self.backend.step,
                                                         failed=failed),
                                      timeout_s=JOIN_POLL_MS / 1000 + CALL_TIMEOUT_S)
            failed = False  # said once is enough
            if reply.group is not None:
                return reply.group
            if reply.reload is not None:  # no live rank holds the state: a newer checkpoint does
                held = self.backend.step
                self.checkpoints.reload()  # the checkpoint being written, if any, is published first
                log.info("%s: no live rank holds model %s's state; loaded its checkpoint at step %d (held %d)",
                         self.name, self.backend.model_id, self.backend.step, held)
            waited_s = time.monotonic() - started
            if waited_s > self.group_wait_s:
                raise GroupNeverFormed(
                    f"model {self.backend.model_id}: no membership to train in within drafter.group_wait_s="
                    f"{self.group_wait_s:g}s (drafter.count="
                    f"{self.spec.size}, min_ranks={self.spec.min_ranks}; waited {waited_s:.0f}s); this rank "
                    f"gives up, holding no jobs")

    def _still_current(self, version: int) -> bool:
        try:
            reply = self.session.call(messages.JoinGroup(wait_ms=0, after=version, step=self.backend.step))
        except NoReply:
            return True  # the dispatcher is restarting: the rendezvous' own bound still holds
        return reply.group is None and reply.membership == version

    def _collective_watch(self, version: int) -> Callable[[], None]:
        """The check a collective of ``version`` makes while it waits: the dispatcher answers every
        heartbeat with the version naming this rank, and once one answered after the wait began
        names none, a peer was lost (it died, or stopped and was declared dead) and the version has
        ended: the wait ends (VersionEnded) rather than at ``drafter.collective_timeout_s``. A
        refused heartbeat (this rank was declared dead while it was paused, or the dispatcher
        restarted) ends it too: the rank registers again (WorkerLost)."""
        channel = self.session.channel
        answered_before, _ = channel.beat_answer()
        rank = self.rank

        def check() -> None:
            if channel.heartbeat_refused.is_set():
                raise WorkerLost("the dispatcher refused our heartbeat while we waited in a collective")
            answered, membership = channel.beat_answer()
            if answered > answered_before and membership == 0:
                raise VersionEnded(f"the dispatcher ended membership {version} (a peer was lost) while rank "
                                   f"{rank} waited")
        return check

    def _open_group(self, waiting_since: float) -> StepGroup:
        m = self.membership
        left_s = self.group_wait_s - (time.monotonic() - waiting_since)
        try:
            return StepGroup(store=m.store, server=self.rendezvous, rank=self.rank, world_size=m.world_size,
                             version=m.membership, timeout_s=self.timeout_s,
                             max_jobs=self.section.exchange_width(m.world_size),
                             device=self.backend.device or "cpu",
                             rendezvous_timeout_s=min(self.timeout_s, max(left_s, 1.0)),
                             still_current=lambda: self._still_current(m.membership),
                             watch=lambda: self._collective_watch(m.membership))
        except RendezvousIncomplete as exc:
            if left_s > 0:
                raise
            raise GroupNeverFormed(f"model {self.backend.model_id}: {exc.arrived} of {m.world_size} ranks came "
                                   f"to the rendezvous of membership {m.membership} within drafter.group_wait_s="
                                   f"{self.group_wait_s:g}s; rank {self.rank} gives up, holding no jobs") from None

    def _transfer(self) -> None:
        """Rank 0 sends its state; every other rank takes it when it holds another step, and checks it."""
        assert self.group is not None
        backend = self.backend
        started = time.perf_counter()
        group, step = self.group, self.membership.step
        device = group.device
        if self.rank == self.membership.source:
            if backend.step != step:
                raise StateTransferFailed(f"the source holds step {backend.step}, the membership says {step}")
            sent = send_state(backend.live_state(), step=step, checksum=backend.weights_checksum(),
                              broadcast=group.broadcast_tensor, device=device)
            log.info("%s: sent the state of step %d (%.1f MB) to membership %d in %.2fs", self.name, step,
                     sent / 1e6, self.version, time.perf_counter() - started)
            return
        state, sent_step, checksum = receive_state(broadcast=group.broadcast_tensor, device=device)
        if sent_step != step:
            raise StateTransferFailed(f"received the state of step {sent_step}, the membership says {step}")
        if backend.step != step:
            backend.load_live_state(state)
            self.state.checkpointed_step = step  # a checkpoint at least this recent exists, written by the group
        if backend.step != step or backend.weights_checksum() != checksum:
            raise StateTransferFailed(f"the state of step {step} does not match its checksum after loading")
        log.info("%s: took the state of step %d from rank %d in %.2fs (weights crc32 %08x)", self.name, step,
                 self.membership.source, time.perf_counter() - started, checksum)

    # -- what a rank whose peers wait for it does ---------------------------------------------
    @staticmethod
    def carries_consumed(job: messages.Job | None, done: bool) -> bool:
        """A rank's consumed goes on its own, acknowledged before its rank 0 commits."""
        return False

    @staticmethod
    def leave(drop_partial_step: Callable[[], None]) -> None:
        """Asked to stop, a rank brings its partial step to a last round with its peers."""

    @staticmethod
    def reports_before_round(reports: list[int], collect: Callable[..., list[int]]) -> list[int]:
        """Rank 0 commits these jobs: every one consumed at the dispatcher before it does."""
        return collect(reports, wait=True)

    @staticmethod
    def settles_now(*, no_job: bool, flush: bool, done: bool, answered: Callable[[], bool]) -> bool:
        """The peers wait for the outcome: settled at once."""
        return True

    @staticmethod
    def resends_commit(stopping: bool) -> bool:
        """The peers wait for the outcome: sent again while dispatcher.reconnect_s allows."""
        return True

    @staticmethod
    def unanswered_commit(exc: Exception, step: int, stopping: bool) -> int:
        """Rank 0's peers wait for an outcome, so every end is one: no dispatcher (NoReply past
        dispatcher.reconnect_s), or an error: ABORTED; a dispatcher that forgot us: PENDING (every
        rank registers again, asking)."""
        return ABORTED if isinstance(exc, (NoReply, ProtocolError)) else PENDING

    @staticmethod
    def after_refusal(rounds: list[RankRound], after: int) -> RoundEnd | None:
        """A refused step: the group goes on with its next round."""
        return None

    @staticmethod
    def idle_round(stepped: bool) -> bool:
        """Whether a round may save and end the run on a ``flush``/``done``: one that holds no jobs
        (the one after the group's last step)."""
        return not stepped

    # -- a round --------------------------------------------------------------------------------
    def await_local_compute(self) -> None:
        """The wait timed at the all-reduce is for the others, not this rank's own queue."""
        assert self.group is not None
        self.group.await_local_compute()

    def measure_round(self, step: int, window: list[int]) -> tuple[int, float]:
        """The compute time of this rank's latest round whose work completed (on a GPU: an earlier
        one), with that round's number: every rank of the version counts the same rounds."""
        self._round_seq += 1
        self.clock.close_step(self._round_seq)
        return ([(0, 0.0)] + self.clock.completed())[-1]

    def exchange(self, mine: RankRound) -> list[RankRound]:
        assert self.group is not None
        return self.group.exchange(mine)

    def sync_gradients(self, all_reduce: Callable[[torch.Tensor], None]) -> None:
        self.backend.sync_gradients(all_reduce)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        assert self.group is not None
        self.group.all_reduce(tensor)

    def commit_fields(self, rounds: list[RankRound], *, busy_s: float, wait_s: float) -> dict[str, Any]:
        """Rank 0's commit, beyond the lone drafter's: every rank's compute time (``busy_s``), rank
        0's all-reduce wait and step wall time so far (``hsd report`` turns them into the group's
        wait share), its version, and what the step-cost model learns from (:meth:`_step_costs`)."""
        return {"busy_s": sum(r.busy_us for r in rounds) / 1e6, "sync_wait_s": wait_s,
                "step_s": time.perf_counter() - self._step_started, "membership": self.version,
                **self._step_costs(rounds)}

    def _step_costs(self, rounds: list[RankRound]) -> dict[str, Any]:
        """Rank 0: each rank's micro-batches of one round and its compute time on them (``cost_jobs``
        when that round is an earlier one than the step being committed, as on a GPU, whose figures
        come a step late)."""
        self._rank_jobs[self._round_seq] = [r.job_ids for r in rounds]
        for old in [seq for seq in self._rank_jobs if seq < self._round_seq - 4]:
            del self._rank_jobs[old]
        measured = {r.busy_step for r in rounds}
        if len(measured) != 1 or rounds[0].busy_step not in self._rank_jobs:
            return {}
        jobs = self._rank_jobs[rounds[0].busy_step]
        late = rounds[0].busy_step != self._round_seq
        return {"rank_jobs": [len(j) for j in jobs], "rank_busy_s": [r.busy_us / 1e6 for r in rounds],
                "cost_jobs": [job_id for ids in jobs for job_id in ids] if late else None}

    def share_outcome(self, outcome: int, after: int, job_ids: list[int]) -> tuple[int, int, Exception | None]:
        """Rank 0's (outcome, version after it) on every rank (the others bring ABORTED and their
        version, overwritten by rank 0's). When the broadcast fails the step's
        fate is still known — rank 0 knows it, the others ask the dispatcher — and comes back with
        the failure, which the loop raises once it applied or dropped the step."""
        assert self.group is not None
        try:
            outcome, after = self.group.broadcast(outcome, after)
        except CollectiveFailed as exc:
            if self.rank != 0:  # rank 0 died inside its commit, or before it: the dispatcher says which
                outcome = COMMITTED if self._committed_without_rank0(job_ids) else ABORTED
            return outcome, after, exc
        return outcome, after, None

    def _committed_without_rank0(self, job_ids: list[int]) -> bool:
        """Whether the step on ``job_ids`` committed, asked of the dispatcher when rank 0's outcome
        never came. The gradients summed already are the group's, so a committed step is applied
        here as on every rank; the answer is final (the version ends as the dispatcher answers)."""
        step = self.backend.step + 1
        try:
            reply = self.session.call_until_answered(messages.StepOutcome(model=self.backend.model_id, step=step,
                                                                          job_ids=job_ids, membership=self.version))
        except (ProtocolError, WorkerLost, DispatcherGone) as exc:
            log.warning("%s: no outcome of step %d from rank 0, and the dispatcher could not say (%s): "
                        "dropped", self.name, step, exc)
            return False
        log.info("%s: rank 0 sent no outcome of step %d; the dispatcher says it %s", self.name, step,
                 "committed: applied" if reply.committed else "did not commit: dropped")
        return reply.committed

    def applied(self, job_ids: list[int], metrics: dict[str, Any], *, busy_s: float, wait_s: float) -> None:
        backend = self.backend
        now = time.perf_counter()
        step_s, self._step_started = now - self._step_started, now
        self.sync_wait_s += wait_s
        self.step_wall_s += step_s
        self.num_applied += 1
        log.info("%s: step %d  rank %d/%d  membership %d  %d micro-batches  loss %.4f  all-reduce wait %.1f ms "
                 "(%.0f%% of %.0f ms)", self.name, backend.step, self.rank, self.world_size, self.version,
                 len(job_ids), metrics.get("loss", float("nan")), 1000 * wait_s, 100 * wait_s / max(step_s, 1e-9),
                 1000 * step_s)
        if self.num_applied == 1:
            started = psutil.Process().create_time()
            log.info("%s: first step %d applied %.1fs after the process started", self.name, backend.step,
                     time.time() - started)
        if self._log_checksums:
            log.info("%s: weights crc32 %08x at step %d", self.name, backend.weights_checksum(), backend.step)

    def run_complete(self) -> None:
        log.info("%s: run complete, rank %d, model %s at step %d (%d memberships, %d steps dropped, "
                 "all-reduce wait %.1f%% of step time)", self.name, self.rank, self.backend.model_id,
                 self.backend.step, self.num_versions, self.state.num_dropped_steps, 100 * self.sync_wait_share)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
