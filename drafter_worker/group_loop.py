"""A drafter rank of a data-parallel group: one optimizer step over every rank's micro-batches.

Drafters that register the same model with ``world_size > 1`` are ranks of one group
(:mod:`dispatcher.groups`). The dispatcher gives each its rank, the membership version and a
FileStore path; the ranks open a ``torch.distributed`` group on it (:mod:`drafter_worker.process_group`).

A step, in the order every rank keeps:

1. each rank pulls and trains on its own micro-batches (``get_hs``; the dispatcher's accumulation
   window spans the whole group, so lengths mix across ranks), and reports them ``consumed``;
2. once it holds ``accum_steps`` micro-batches (fewer when the dispatcher says ``flush`` or
   ``done``) it waits for its ``consumed`` replies and enters the **round**: the ranks exchange
   their job ids as fixed-size int64 rows (no pickle), then all-reduce the gradients and the
   supervised-position total (the backend's ``sync_gradients``);
3. rank 0 alone commits the step, naming every rank's jobs; the dispatcher accepts jobs consumed by
   any current member. Rank 0 broadcasts the outcome, and only then does every rank apply the step
   (commit, then apply) or drop it;
4. when every rank has nothing left (``flush``) and steps are not yet saved, rank 0 checkpoints
   (the weights are the same on every rank).

Failure: a dead rank makes the others' collectives fail (gloo sees the closed socket, or the
``drafter.collective_timeout_s`` bound expires), and the dispatcher, seeing a member gone, answers
the others ``group_changed``. Either way every surviving rank drops the step, closes the group,
reloads the latest checkpoint and registers again with its step: the dispatcher rolls the ledger
back to it and forms the group anew under a new membership version. A peer lost for good (its
restarts spent, its host gone) would keep the others at the rendezvous forever: a rank whose group
does not form within ``drafter.group_wait_s`` leaves the dispatcher and exits with an error
(:class:`GroupNeverFormed`), naming the model, the membership version and how many ranks came.

The time from a rank's local gradients being ready to the all-reduce completing (the wait for the
slowest rank plus the exchange itself) is logged per step with its share of the step's wall time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.config import Config
from drafter_worker.loop import DrafterLoop
from common.protocol import ErrorCode, ProtocolError
from common.transport import DrafterTransport
from common.worker_runtime import CALL_TIMEOUT_S, RECONNECT_S, NoReply, WorkerLost
from drafter_worker.process_group import CollectiveFailed, RankRound, RendezvousIncomplete, StepGroup

log = logging.getLogger("hsd.drafter")

COMMITTED, REFUSED, ABORTED = 1, 0, -1  # rank 0's commit outcome, broadcast to every rank
GROUP_NEVER_FORMED_EXIT = 4  # exit code of a rank whose group did not form within drafter.group_wait_s


class GroupChanged(WorkerLost):
    """The membership version ended (a rank died or left, or a collective failed): start over."""

    what = "the data-parallel group must form again"


class GroupNeverFormed(RuntimeError):
    """The group did not form within ``drafter.group_wait_s``: a peer is lost for good. The rank
    leaves (the dispatcher gives back whatever it held) and its process exits with an error."""


class GroupDrafterLoop(DrafterLoop):
    def __init__(self, config: Config, name: str, backend: Any, **kwargs: Any):
        super().__init__(config, name, backend, **kwargs)
        self.world_size = config.drafter.group_size
        if self.world_size < 2:
            raise ValueError("a data-parallel drafter needs drafter.count > 1 and drafter.data_parallel=true")
        self.timeout_s = config.drafter.collective_timeout_s
        self.group_wait_s = config.drafter.group_wait_s
        self._waiting_since: float | None = None  # when this rank began waiting for a group to form
        self.group: StepGroup | None = None
        self.rank = -1
        self.num_regroups = 0
        self.sync_wait_s = 0.0  # summed over applied steps
        self.step_wall_s = 0.0
        self._step_started = time.perf_counter()

    def run(self) -> int:
        """The worker loop; a group that never formed is an error exit (the session has left by then)."""
        try:
            return super().run()
        except GroupNeverFormed as exc:
            log.error("%s: %s", self.name, exc)
            return GROUP_NEVER_FORMED_EXIT

    # -- membership -----------------------------------------------------------------------------
    def _model_fields(self) -> dict[str, Any]:
        return {**super()._model_fields(), "world_size": self.world_size}

    def _register(self) -> dict[str, Any]:
        reply = super()._register()
        if "group" not in reply:
            raise RuntimeError("the dispatcher formed no data-parallel group for this drafter (an older dispatcher?)")
        return reply

    def _lost(self) -> None:
        """The step is void on every rank: drop it, and start again from the latest checkpoint."""
        self._close_group()
        super()._lost()
        self.backend.drop_step()
        self.window, self.busy_s = [], 0.0
        self._reload()
        self.num_regroups += 1
        log.warning("%s: model %s goes back to its checkpoint at step %d and joins the group again", self.name,
                    self.backend.model_id, self.backend.step)

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # -- the loop -------------------------------------------------------------------------------
    def _work(self, registration: dict[str, Any], transport: DrafterTransport) -> None:
        info = registration["group"]
        self.rank = info["rank"]
        try:
            self.group = self._join(info, registration["accum_steps"])
            self._train(registration["accum_steps"], transport)
        except CollectiveFailed as exc:
            raise GroupChanged(str(exc)) from None
        except ProtocolError as exc:
            if exc.code == ErrorCode.GROUP_CHANGED:
                raise GroupChanged(exc.message) from None
            raise
        finally:
            self._close_group()

    def _join(self, info: dict[str, Any], accum_steps: int) -> StepGroup:
        """The rendezvous of this membership version, within what is left of ``drafter.group_wait_s``.

        The wait runs from the moment this rank started waiting for a group to form (its start, or
        the end of the last formed group) across every re-registration in between, and ends when a
        group forms. A rendezvous that fails once the wait is spent raises GroupNeverFormed."""
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        left_s = self.group_wait_s - (now - self._waiting_since)
        try:
            group = StepGroup(store_path=info["store"], rank=self.rank, world_size=info["world_size"],
                              version=info["membership"], timeout_s=self.timeout_s, max_jobs=accum_steps,
                              device=getattr(self.backend, "device", "cpu"),
                              rendezvous_timeout_s=min(self.timeout_s, max(left_s, 1.0)))
        except RendezvousIncomplete as exc:
            waited_s = time.monotonic() - self._waiting_since
            if waited_s < self.group_wait_s:
                raise
            raise GroupNeverFormed(
                f"model {self.backend.model_id}: the data-parallel group did not form within drafter.group_wait_s="
                f"{self.group_wait_s:g}s: {exc.arrived} of {info['world_size']} ranks came to the rendezvous of "
                f"membership {info['membership']} (waited {waited_s:.0f}s); rank {self.rank} gives up, holding "
                f"no jobs") from None
        self._waiting_since = None
        return group

    def _train(self, accum_steps: int, transport: DrafterTransport) -> None:
        self.window, self.busy_s, self.commit = [], 0.0, None
        self._step_started = time.perf_counter()
        reports: list[int] = []
        poll = self._poll("get_hs")
        while True:
            reply = self._await_poll(poll, "get_hs")
            if self.stopping:
                self._stop_rank(reports)
                return
            done, flush, job = reply["done"], reply.get("flush", False), reply["job"]
            if not done:
                poll = self._poll("get_hs")
            self._report_durable()  # rank 0's checkpoint, once its writer has it on disk
            reports = self._collect(reports)
            if job is not None:
                self._train_on(job, transport, reports)
            if len(self.window) >= accum_steps or flush or done:
                # Rank 0 commits these jobs: they must be consumed at the dispatcher before it does.
                reports = self._collect(reports, wait=True)
                if self._round(done=done, flush=flush):
                    log.info("%s: run complete, rank %d, model %s at step %d (%d regroups, %d steps dropped, "
                             "all-reduce wait %.1f%% of step time)", self.name, self.rank, self.backend.model_id,
                             self.backend.step, self.num_regroups, self.num_dropped_steps, 100 * self.sync_wait_share)
                    return

    @property
    def sync_wait_share(self) -> float:
        return self.sync_wait_s / self.step_wall_s if self.step_wall_s > 0 else 0.0

    def _round(self, *, done: bool, flush: bool) -> bool:
        """One step of the group (or none when no rank has work); True once the run is complete."""
        assert self.group is not None
        ready_at = time.perf_counter()
        rounds = self.group.exchange(RankRound(self.rank, list(self.window), done, flush,
                                               busy_us=int(self.busy_s * 1e6)))
        job_ids = [job_id for r in rounds for job_id in r.job_ids]
        if not job_ids:
            if all(r.flush or r.done for r in rounds) and self.backend.step > self.checkpointed_step:
                self._group_checkpoint()
            return any(r.done for r in rounds)
        self.backend.sync_gradients(self.group.all_reduce)
        wait_s = time.perf_counter() - ready_at
        if self.rank == 0:
            busy_s = sum(r.busy_us for r in rounds) / 1e6
            step_s = time.perf_counter() - self._step_started
            outcome = self.group.broadcast(self._commit_as_rank0(job_ids, busy_s=busy_s, wait_s=wait_s, step_s=step_s))
        else:
            outcome = self.group.broadcast(ABORTED)
        mine = list(self.window)
        self.window, self.busy_s = [], 0.0
        if outcome != COMMITTED:
            self.backend.drop_step()
            self.session.held.discard(mine)  # the dispatcher took them back: the next heartbeat agrees
            self.num_dropped_steps += 1
            if outcome == ABORTED:
                raise GroupChanged(f"step {self.backend.step + 1} was not committed: the group changed")
            return False
        self.session.held.discard(mine)
        metrics = self.backend.apply_step(job_ids)
        now = time.perf_counter()
        step_s, self._step_started = now - self._step_started, now
        self.sync_wait_s += wait_s
        self.step_wall_s += step_s
        log.info("%s: step %d  rank %d  %d micro-batches  loss %.4f  all-reduce wait %.1f ms (%.0f%% of %.0f ms)",
                 self.name, self.backend.step, self.rank, len(job_ids), metrics.get("loss", float("nan")),
                 1000 * wait_s, 100 * wait_s / max(step_s, 1e-9), 1000 * step_s)
        if self.backend.step - self.checkpointed_step >= self.checkpoint_every:
            self._group_checkpoint()
        return False

    def _commit_as_rank0(self, job_ids: list[int], *, busy_s: float, wait_s: float, step_s: float) -> int:
        """Commit the step for the whole group; the outcome every rank then follows. ``busy_s`` is
        every rank's compute time; ``wait_s`` and ``step_s`` are rank 0's all-reduce wait and step
        wall time so far (``hsd report`` turns them into the group's wait share)."""
        fields = {"model": self.backend.model_id, "step": self.backend.step + 1, "job_ids": job_ids,
                  "busy_s": busy_s, "sync_wait_s": wait_s, "step_s": step_s}
        deadline = time.monotonic() + RECONNECT_S
        request_id = self.session.submit("commit_step", **fields)
        while True:
            try:
                self.session.result(request_id, timeout_s=CALL_TIMEOUT_S)
                return COMMITTED
            except NoReply:
                if time.monotonic() > deadline:
                    return ABORTED
                log.warning("%s: commit of step %d got no reply; sending it again", self.name, fields["step"])
            except WorkerLost:
                return ABORTED  # the dispatcher forgot us: every rank registers again
            except ProtocolError as exc:
                if exc.code == ErrorCode.BAD_STATE:
                    log.warning("%s: step %d refused, dropped: %s", self.name, fields["step"], exc.message)
                    return REFUSED
                if exc.code == ErrorCode.INTERNAL and time.monotonic() <= deadline:
                    time.sleep(1.0)  # not made durable: the same commit goes to the next dispatcher
                else:
                    return ABORTED
            request_id = self.session.submit("commit_step", **fields)

    def _group_checkpoint(self) -> None:
        """Rank 0 saves, off its training thread (every rank holds the same weights); the others
        note the step as saved."""
        if self.rank == 0:
            self._checkpoint()
        else:
            self.checkpointed_step = self.backend.step

    def _stop_rank(self, reports: list[int]) -> None:
        """A clean stop: leave the group first (the other ranks' collectives fail at once), drop the
        partial step, and let rank 0 save what was applied."""
        self._close_group()
        try:
            self._collect(reports, wait=True)
        except (WorkerLost, ProtocolError) as exc:
            log.warning("%s: stopping without the last answers: %s", self.name, exc)
        if self.window:
            self.backend.drop_step()
            self.session.held.discard(self.window)
            self.window, self.busy_s = [], 0.0
        if self.rank == 0:
            self._finish_checkpoints()
