"""A rank of an elastic data-parallel group: one optimizer step over every rank's micro-batches.

Drafters that register the same model as ranks of a group (:mod:`dispatcher.groups`) train it
together. A rank registers, then asks ``join_group`` for the membership version that names it: its
rank, the world size, the store of the version's rendezvous (a FileStore path, or across nodes
rank 0's TCPStore: :mod:`drafter_worker.rendezvous`), the version's step, and
whether a state transfer comes first. The ranks open a ``torch.distributed`` group on it
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

Failure: a dead rank makes the others' collectives fail (gloo sees the closed socket, or
``drafter.collective_timeout_s`` expires). The step commits nothing; every survivor drops it and
asks for the next version saying its version failed, which ends it at once; the dispatcher opens
the next one with the ranks still alive, and they carry on from their own weights. A rank that finds
no version to train in within ``drafter.group_wait_s`` (too few ranks for ``drafter.min_ranks``, or
for ``drafter.count`` in a new group) leaves and exits with an error (:class:`GroupNeverFormed`).

The time from a rank's local gradients being ready to the all-reduce completing (the wait for the
slowest rank plus the exchange itself) is logged per step with its share of the step's wall time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psutil
import torch

from common import faults
from common.config import Config
from common.protocol import ErrorCode, ProtocolError
from common.transport import DrafterTransport
from common.worker_runtime import CALL_TIMEOUT_S, DispatcherGone, NoReply, WorkerLost
from drafter_worker.loop import DrafterLoop
from drafter_worker.process_group import CollectiveFailed, RankRound, RendezvousIncomplete, StepGroup
from drafter_worker.rendezvous import RendezvousServer
from drafter_worker.state_transfer import StateTransferFailed, receive_state, send_state

log = logging.getLogger("hsd.drafter")

# rank 0's commit outcome, broadcast to every rank (PENDING: the dispatcher restarted before it
# answered; every rank keeps the step and asks the next one when it registers)
COMMITTED, REFUSED, ABORTED, PENDING = 1, 0, -1, 2
GROUP_NEVER_FORMED_EXIT = 4  # exit code of a rank that found no version to train in within drafter.group_wait_s
RUN_DONE, NEXT_VERSION, LEAVE = "done", "next", "leave"  # how a version ends for a rank
JOIN_POLL_MS = 1000


class GroupNeverFormed(RuntimeError):
    """No version to train in within ``drafter.group_wait_s``: peers are lost for good. The rank
    leaves (the dispatcher gives back whatever it held) and its process exits with an error."""


class GroupDrafterLoop(DrafterLoop):
    def __init__(self, config: Config, name: str, backend: Any, **kwargs: Any):
        super().__init__(config, name, backend, **kwargs)
        if not config.drafter.grouped:
            raise ValueError("a data-parallel drafter needs drafter.data_parallel=true and drafter.count > 1 "
                             "or drafter.max_ranks > 1")
        section = config.drafter
        self.spec = {"size": section.group_size, "min_ranks": section.min_ranks, "max_ranks": section.max_ranks,
                     "balance": section.step_balance, "accum_steps": section.accum_steps,
                     "elastic_batch": section.elastic_batch}
        self.timeout_s = section.collective_timeout_s
        self.group_wait_s = section.group_wait_s
        # drafter.rendezvous=tcp: the store this rank hosts for the versions whose rank 0 it is
        self.rendezvous = RendezvousServer.for_config(config) if config.group_rendezvous == "tcp" else None
        self.group: StepGroup | None = None
        self.membership: dict[str, Any] = {}
        self.rank = -1
        self.accum = section.accum_steps
        self._round_seq = 0  # rounds of the current version
        self._rank_jobs: dict[int, list[list[int]]] = {}  # rank 0: each rank's job ids of the latest rounds
        self.num_versions = 0
        self.num_applied = 0  # steps this process applied (its first one is logged with its start-up time)
        self.sync_wait_s = 0.0  # summed over applied steps
        self.step_wall_s = 0.0
        self._step_started = time.perf_counter()
        # test-only faults (common.faults): kill_at points of this rank, the weights' CRC32 logged per step
        self._kill_at = faults.kills_armed()
        self._log_checksums = faults.log_weight_checksums()

    def run(self) -> int:
        """The worker loop; no version to train in is an error exit (the session has left by then)."""
        try:
            return super().run()
        except GroupNeverFormed as exc:
            log.error("%s: %s", self.name, exc)
            return GROUP_NEVER_FORMED_EXIT

    # -- membership -----------------------------------------------------------------------------
    def _model_fields(self) -> dict[str, Any]:
        store = {"store": self.rendezvous.address} if self.rendezvous is not None else {}
        return {**super()._model_fields(), "group": {**self.spec, **store}}

    def _check_registered_step(self, reply: dict[str, Any]) -> None:
        """A rank's step matters only when its version opens (a live rank's state may replace it)."""

    def _lost(self) -> None:
        self._close_group()
        pending = self.pending  # a step whose commit the restarted dispatcher may hold (PENDING)
        super()._lost()
        self.pending = pending
        if pending is None:
            self.backend.drop_step()
        self.window = []
        self.clock.discard_open()

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _poll(self, op: str) -> int:
        if op == "get_hs":  # a poll names its version: one sent before a change is answered group_changed
            return self.session.submit(op, wait_ms=self.poll_ms, membership=self.membership["membership"])
        return super()._poll(op)

    def _join_group(self, *, after: int, failed: bool, started: float) -> dict[str, Any]:
        """The next version that names this rank, asked for until ``drafter.group_wait_s`` is spent."""
        while True:
            if self.stopping:
                raise WorkerLost("asked to stop while waiting for a membership")
            reply = self.session.call("join_group", timeout_s=JOIN_POLL_MS / 1000 + CALL_TIMEOUT_S,
                                      wait_ms=JOIN_POLL_MS, after=after, step=self.backend.step, failed=failed)
            failed = False  # said once is enough
            if reply["group"] is not None:
                return reply["group"]
            if reply.get("reload") is not None:  # no live rank holds the state: a newer checkpoint does
                held = self.backend.step
                self._reload()  # the checkpoint being written, if any, is published first
                log.info("%s: no live rank holds model %s's state; loaded its checkpoint at step %d (held %d)",
                         self.name, self.backend.model_id, self.backend.step, held)
            waited_s = time.monotonic() - started
            if waited_s > self.group_wait_s:
                raise GroupNeverFormed(
                    f"model {self.backend.model_id}: no membership to train in within drafter.group_wait_s="
                    f"{self.group_wait_s:g}s (drafter.count="
                    f"{self.spec['size']}, min_ranks={self.spec['min_ranks']}; waited {waited_s:.0f}s); this rank "
                    f"gives up, holding no jobs")

    def _still_current(self, version: int) -> bool:
        try:
            reply = self.session.call("join_group", wait_ms=0, after=version, step=self.backend.step)
        except NoReply:
            return True  # the dispatcher is restarting: the rendezvous' own bound still holds
        return reply["group"] is None and reply["membership"] == version

    # -- the loop -------------------------------------------------------------------------------
    def _work(self, registration: dict[str, Any], transport: DrafterTransport) -> None:
        after, failed = 0, False
        waiting_since = time.monotonic()
        while True:
            self.membership = self._join_group(after=after, failed=failed, started=waiting_since)
            version = self.membership["membership"]
            self.rank, world_size = self.membership["rank"], self.membership["world_size"]
            self.accum = self.config.drafter.rank_accum_steps(rank=self.rank, world_size=world_size)
            self.session.held.clear()  # what the last version held went back when it ended
            self.num_versions += 1
            try:
                self.group = self._open_group(waiting_since)
                waiting_since = time.monotonic()
                if self.membership["transfer"]:
                    self._transfer()
                ended = self._train(transport)
                failed = False
            except CollectiveFailed as exc:
                log.warning("%s: membership %d failed: %s", self.name, version, exc)
                ended, failed = NEXT_VERSION, True
            except StateTransferFailed as exc:
                # the state it holds may be half loaded: back to its checkpoint, then in line as a joiner
                log.warning("%s: membership %d: the state transfer failed (%s); registering again", self.name,
                            version, exc)
                self._close_group()
                if self.rank != self.membership["source"]:
                    self._reload()
                raise WorkerLost(f"state transfer of membership {version} failed") from None
            except ProtocolError as exc:
                if exc.code != ErrorCode.GROUP_CHANGED:
                    raise
                log.info("%s: membership %d ended: %s", self.name, version, exc.message)
                ended, failed = NEXT_VERSION, False
            finally:
                self._close_group()
            if self.window:
                self.backend.drop_step()
                self.num_dropped_steps += 1
                self.window = []
                self.clock.discard_open()
            if ended in (RUN_DONE, LEAVE):
                return
            after = version

    def _open_group(self, waiting_since: float) -> StepGroup:
        m = self.membership
        left_s = self.group_wait_s - (time.monotonic() - waiting_since)
        try:
            return StepGroup(store=m["store"], server=self.rendezvous, rank=self.rank, world_size=m["world_size"],
                             version=m["membership"], timeout_s=self.timeout_s,
                             max_jobs=self.config.drafter.exchange_width(m["world_size"]),
                             device=getattr(self.backend, "device", "cpu"),
                             rendezvous_timeout_s=min(self.timeout_s, max(left_s, 1.0)),
                             still_current=lambda: self._still_current(m["membership"]))
        except RendezvousIncomplete as exc:
            if left_s > 0:
                raise
            raise GroupNeverFormed(f"model {self.backend.model_id}: {exc.arrived} of {m['world_size']} ranks came "
                                   f"to the rendezvous of membership {m['membership']} within drafter.group_wait_s="
                                   f"{self.group_wait_s:g}s; rank {self.rank} gives up, holding no jobs") from None

    def _transfer(self) -> None:
        """Rank 0 sends its state; every other rank takes it when it holds another step, and checks it."""
        assert self.group is not None
        started = time.perf_counter()
        group, step = self.group, self.membership["step"]
        device = group.device
        if self.rank == self.membership["source"]:
            if self.backend.step != step:
                raise StateTransferFailed(f"the source holds step {self.backend.step}, the membership says {step}")
            sent = send_state(self.backend.live_state(), step=step, checksum=self.backend.weights_checksum(),
                              broadcast=group.broadcast_tensor, device=device)
            log.info("%s: sent the state of step %d (%.1f MB) to membership %d in %.2fs", self.name, step,
                     sent / 1e6, self.membership["membership"], time.perf_counter() - started)
            return
        state, sent_step, checksum = receive_state(broadcast=group.broadcast_tensor, device=device)
        if sent_step != step:
            raise StateTransferFailed(f"received the state of step {sent_step}, the membership says {step}")
        if self.backend.step != step:
            self.backend.load_live_state(state)
            self.checkpointed_step = step  # a checkpoint at least this recent exists, written by the group
        if self.backend.step != step or self.backend.weights_checksum() != checksum:
            raise StateTransferFailed(f"the state of step {step} does not match its checksum after loading")
        log.info("%s: took the state of step %d from rank %d in %.2fs (weights crc32 %08x)", self.name, step,
                 self.membership["source"], time.perf_counter() - started, checksum)

    def _train(self, transport: DrafterTransport) -> str:
        self.window, self.commit = [], None
        self.clock.reset()  # rounds are counted per version: every rank of it counts the same ones
        self._round_seq, self._rank_jobs = 0, {}
        self._step_started = time.perf_counter()
        reports: list[int] = []
        poll: int | None = self._poll("get_hs")
        while True:
            reply = self._await_poll(poll, "get_hs")
            poll = None
            leaving = self.stopping
            done, flush, job = reply["done"], reply.get("flush", False), reply["job"]
            # step_balance=cost: the dispatcher says when this rank holds its share of the step (a
            # reply about a step that has committed since is stale)
            full = reply.get("step_full") == self.backend.step + 1
            if not leaving:
                if not done:  # told step_full too: the dispatcher holds this poll until the step commits
                    poll = self._poll("get_hs")
                self._report_durable()  # rank 0's checkpoint, once its writer has it on disk
                reports = self._collect(reports)
                if job is not None:
                    self._train_on(job, transport, reports)
            if leaving or full or len(self.window) >= self.accum or flush or done:
                # Rank 0 commits these jobs: they must be consumed at the dispatcher before it does.
                reports = self._collect(reports, wait=True)
                ended = self._round(done=done and not leaving, flush=flush, leaving=leaving)
                if ended is not None:
                    if ended == RUN_DONE:
                        log.info("%s: run complete, rank %d, model %s at step %d (%d memberships, %d steps dropped, "
                                 "all-reduce wait %.1f%% of step time)", self.name, self.rank, self.backend.model_id,
                                 self.backend.step, self.num_versions, self.num_dropped_steps,
                                 100 * self.sync_wait_share)
                    return ended
            if poll is None:
                poll = self._poll("get_hs")

    def _train_on(self, job: dict[str, Any], transport: DrafterTransport, reports: list[int]) -> None:
        if len(self.window) == 1:
            self._test_fault("micro_batch")
            if self._kill_at:  # inside autograd's backward of this micro-batch, whatever the backend
                def unpacked(tensor: torch.Tensor) -> torch.Tensor:  # autograd unpacks saved tensors in backward
                    self._test_fault("backward")
                    return tensor

                with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpacked):
                    super()._train_on(job, transport, reports)
                return
        super()._train_on(job, transport, reports)

    @property
    def sync_wait_share(self) -> float:
        return self.sync_wait_s / self.step_wall_s if self.step_wall_s > 0 else 0.0

    def _round(self, *, done: bool, flush: bool, leaving: bool) -> str | None:
        """One step of the group (or none when no rank has work); how the version ends, if it does."""
        assert self.group is not None
        self.group.await_local_compute()  # the wait timed below is for the others, not this rank's own queue
        ready_at = time.perf_counter()
        # the compute time of this rank's latest round whose work completed (on a GPU: an earlier one)
        self._round_seq += 1
        self.clock.close_step(self._round_seq)
        busy_step, busy_s = ([(0, 0.0)] + self.clock.completed())[-1]
        rounds = self.group.exchange(RankRound(self.rank, list(self.window), done, flush, busy_us=int(busy_s * 1e6),
                                               leaving=leaving, busy_step=busy_step))
        job_ids = [job_id for r in rounds for job_id in r.job_ids]
        someone_leaves = any(r.leaving for r in rounds)
        if not job_ids:
            if all(r.flush or r.done or r.leaving for r in rounds) and self.backend.step > self.checkpointed_step:
                self._group_checkpoint(all_leave=all(r.leaving for r in rounds))
            if any(r.done for r in rounds):
                return RUN_DONE
            return (LEAVE if leaving else NEXT_VERSION) if someone_leaves else None
        self.backend.sync_gradients(self._all_reduce)
        wait_s = time.perf_counter() - ready_at
        version = self.membership["membership"]
        if self.rank == 0:
            busy_s = sum(r.busy_us for r in rounds) / 1e6
            step_s = time.perf_counter() - self._step_started
            outcome, after = self._commit_as_rank0(job_ids, busy_s=busy_s, wait_s=wait_s, step_s=step_s,
                                                   costs=self._step_costs(rounds))
            if outcome == COMMITTED:
                self._test_fault("committed")
            try:
                outcome, after = self.group.broadcast(outcome, after)
            except CollectiveFailed:
                if outcome == COMMITTED:  # durable, and the gradients are the group's: rank 0 holds the step
                    self.session.held.discard(list(self.window))
                    self.window = []
                    self._apply(job_ids, wait_s)
                raise
        else:
            try:
                outcome, after = self.group.broadcast(ABORTED, version)
            except CollectiveFailed:
                # rank 0 died inside its commit, or before it: the dispatcher says which
                if self._committed_without_rank0(job_ids, version):
                    self.session.held.discard(list(self.window))
                    self.window = []
                    self._apply(job_ids, wait_s)
                raise
        mine = list(self.window)
        self.window = []
        if outcome == PENDING:
            self.session.held.discard(mine)
            self.pending = {"step": self.backend.step + 1, "job_ids": job_ids}
            raise WorkerLost(f"the dispatcher restarted before it answered the commit of step {self.backend.step + 1}")
        if outcome != COMMITTED:
            self.backend.drop_step()
            self.session.held.discard(mine)  # the dispatcher took them back: the next heartbeat agrees
            self.num_dropped_steps += 1
            if outcome == ABORTED:
                raise CollectiveFailed(f"step {self.backend.step + 1} was not committed: the membership changed")
            return None
        self.session.held.discard(mine)
        self._apply(job_ids, wait_s)
        if leaving or someone_leaves:
            if all(r.leaving for r in rounds) and self.backend.step > self.checkpointed_step:
                self._group_checkpoint(all_leave=True)
            return LEAVE if leaving else NEXT_VERSION
        if after != version:
            return NEXT_VERSION  # ranks wait to join at this step boundary
        if self.backend.step - self.checkpointed_step >= self.checkpoint_every:
            self._group_checkpoint()
        return None

    def _all_reduce(self, tensor) -> None:
        assert self.group is not None
        self._test_fault("allreduce")  # the peers are in the all-reduce, waiting for this rank
        self.group.all_reduce(tensor)

    def _apply(self, job_ids: list[int], wait_s: float) -> None:
        metrics = self.backend.apply_step(job_ids)
        now = time.perf_counter()
        step_s, self._step_started = now - self._step_started, now
        self.sync_wait_s += wait_s
        self.step_wall_s += step_s
        self.num_applied += 1
        log.info("%s: step %d  rank %d/%d  membership %d  %d micro-batches  loss %.4f  all-reduce wait %.1f ms "
                 "(%.0f%% of %.0f ms)", self.name, self.backend.step, self.rank, self.membership["world_size"],
                 self.membership["membership"], len(job_ids), metrics.get("loss", float("nan")), 1000 * wait_s,
                 100 * wait_s / max(step_s, 1e-9), 1000 * step_s)
        if self.num_applied == 1:
            started = psutil.Process().create_time()
            log.info("%s: first step %d applied %.1fs after the process started", self.name, self.backend.step,
                     time.time() - started)
        if self._log_checksums:
            log.info("%s: weights crc32 %08x at step %d", self.name, self.backend.weights_checksum(),
                     self.backend.step)

    def _step_costs(self, rounds: list[RankRound]) -> dict[str, Any]:
        """Rank 0: what the dispatcher's step-cost model learns from — each rank's micro-batches of
        one round and its compute time on them (``cost_jobs`` when that round is an earlier one than
        the step being committed, as on a GPU, whose figures come a step late)."""
        self._rank_jobs[self._round_seq] = [r.job_ids for r in rounds]
        for old in [seq for seq in self._rank_jobs if seq < self._round_seq - 4]:
            del self._rank_jobs[old]
        measured = {r.busy_step for r in rounds}
        if len(measured) != 1 or rounds[0].busy_step not in self._rank_jobs:
            return {}
        jobs = self._rank_jobs[rounds[0].busy_step]
        costs = {"rank_jobs": [len(j) for j in jobs], "rank_busy_s": [r.busy_us / 1e6 for r in rounds]}
        if rounds[0].busy_step != self._round_seq:
            costs["cost_jobs"] = [job_id for ids in jobs for job_id in ids]
        return costs

    def _committed_without_rank0(self, job_ids: list[int], version: int) -> bool:
        """Whether the step on ``job_ids`` committed, asked of the dispatcher when rank 0's outcome
        never came. The gradients summed already are the group's, so a committed step is applied
        here as on every rank; the answer is final (the version ends as the dispatcher answers)."""
        step = self.backend.step + 1
        try:
            reply = self.session.call_until_answered("step_outcome", model=self.backend.model_id, step=step,
                                                     job_ids=job_ids, membership=version)
        except (ProtocolError, WorkerLost, DispatcherGone) as exc:
            log.warning("%s: no outcome of step %d from rank 0, and the dispatcher could not say (%s): "
                        "dropped", self.name, step, exc)
            return False
        log.info("%s: rank 0 sent no outcome of step %d; the dispatcher says it %s", self.name, step,
                 "committed: applied" if reply["committed"] else "did not commit: dropped")
        return bool(reply["committed"])

    def _commit_as_rank0(self, job_ids: list[int], *, busy_s: float, wait_s: float, step_s: float,
                         costs: dict[str, Any]) -> tuple[int, int]:
        """Commit the step for the whole group: (the outcome every rank then follows, the group's
        version after it). ``busy_s`` is every rank's compute time; ``wait_s`` and ``step_s`` are
        rank 0's all-reduce wait and step wall time so far (``hsd report`` turns them into the
        group's wait share); ``costs`` are :meth:`_step_costs`."""
        version = self.membership["membership"]
        fields = {"model": self.backend.model_id, "step": self.backend.step + 1, "job_ids": job_ids,
                  "busy_s": busy_s, "sync_wait_s": wait_s, "step_s": step_s, "membership": version, **costs}
        # Sent again as a lone drafter's commit is; but where that one raises (and registers again),
        # rank 0 turns every end into an outcome: its peers wait for it in the broadcast that follows.
        try:
            reply = self._commit_until_answered(fields)
        except NoReply:
            return ABORTED, version
        except WorkerLost:
            return PENDING, version  # the dispatcher forgot us: every rank registers again, asking
        except ProtocolError as exc:
            if exc.code != ErrorCode.BAD_STATE:
                return ABORTED, version  # internal past RECONNECT_S, or any other error
            log.warning("%s: step %d refused, dropped: %s", self.name, fields["step"], exc.message)
            return REFUSED, version
        return COMMITTED, int(reply.get("membership", version))

    def _group_checkpoint(self, *, all_leave: bool = False) -> None:
        """Rank 0 saves, off its training thread (every rank holds the same weights); the others
        note the step as saved."""
        if self.rank == 0:
            self._checkpoint(best_effort=all_leave)
            if all_leave:  # the group stops: its last checkpoint is on disk, and said, before the ranks go
                self._wait_for_writer()
                self._report_durable(best_effort=True)
        else:
            self.checkpointed_step = self.backend.step

    def _test_fault(self, point: str) -> None:
        """``kill_at``: only in a step this rank trains with peers."""
        if self._kill_at and self.membership["world_size"] > 1:
            faults.kill_at(self.name, point, step=self.backend.step + 1, run_dir=self.run_dir)
