"""One membership version's ``torch.distributed`` process group, and the few collectives a step needs.

The dispatcher names a fresh store per membership version — a ``FileStore`` path on one node, or
rank 0's ``TCPStore`` under a key prefix of the version's own across nodes
(:mod:`drafter_worker.rendezvous`); every rank opens it and joins with the rank it was given,
first marking its arrival in the store (so a rendezvous that fails can say how many ranks came).
Every collective is bounded by ``drafter.collective_timeout_s``, so a rank whose peer died never
waits longer than that (gloo usually notices a dead peer's closed socket at once, and a client of a
dead rank 0's TCPStore its closed connection). No pickle: job ids travel as fixed-size int64
tensors, never through ``all_gather_object``.

**On GPUs a dead peer must fail a collective the way it does under gloo**, never kill or hang a
survivor. NCCL does neither by itself: its collectives return at once and the kernel then spins
for the dead peer, a host read behind it blocks, and the watchdog's default answer to the timeout
is SIGABRT. So:

* the group has two backends (``cpu:gloo,cuda:nccl``): every small exchange — the job-id rows,
  the commit outcome, whatever the host reads with ``.tolist()`` — is a CPU tensor and runs on
  gloo; NCCL carries only device tensors (the gradient buckets, the step sums, a state transfer);
* every collective is issued ``async_op=True`` and waited for by polling its completion against
  the timeout (:func:`drafter_worker.collective_wait.wait_bounded`); past it, or on any error, the
  rank aborts the communicator at once (``ncclCommAbort``: the spinning kernel returns) and raises
  :class:`CollectiveFailed`, as gloo would have;
* the watchdog is told not to act (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, no dump on timeout, no
  heartbeat monitor: each of those ends in SIGABRT), since every wait is bounded on the host;
* the NCCL communicator is built when the group opens (``device_id``), not lazily inside the first
  step's all-reduce, under a bound of ``drafter.collective_timeout_s``: ``ncclCommInitRank`` waits
  for every rank and a rank that died after it arrived would hang the others there, so past the
  bound the rank exits (``ABORT_HUNG_EXIT``) and restarts as a joiner; it is released by abort,
  never ``ncclCommDestroy``: destroy waits for every peer to destroy too, which a dead peer never does. Should abort itself not return (some NCCL
  versions hang in it), the rank exits after ``ABORT_BOUND_S`` (code ``ABORT_HUNG_EXIT``) and
  restarts as a joiner: a lost process, never a hung group.

**A peer that is only stopped** (SIGSTOP, a host asleep) fails nothing: its sockets stay open and
gloo waits out the whole bound. So each collective's wait also runs a check the rank's step group
gives it (``watch``), which raises once the dispatcher said the version ended (it declared the
peer dead); the rank leaves the collective then. A gloo group whose collective is still in flight
cannot be destroyed (its destructor joins the thread blocked in it): it is kept aside, unused, until
that collective ends, and leaked if the process exits first.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from common.wire.store_names import parse_tcp_store, store_address
from drafter_worker.collective_wait import call_bounded, wait_bounded
from drafter_worker.rendezvous import RendezvousServer
from drafter_worker.step_group import CollectiveFailed, RankRound

log = logging.getLogger("hsd.drafter")

NO_JOB = -1  # padding of a rank's job id row
HEAD = 6  # fields before the job ids in a row
WATCH_S = 0.25  # a rank at the rendezvous asks this often whether its version still stands
ARRIVAL_POLL_S = 0.02  # and looks this often whether every rank came (a TCPStore wait that times out logs a warning)
ARRIVED_KEY = "hsd/arrived"  # + "/<rank>": set in the store by each rank that came to the rendezvous
# What ProcessGroupNCCL's watchdog does about a timeout or an error: nothing. Each of these would end
# in SIGABRT (tear down on error, dump and then terminate, terminate when the watchdog stalls);
# every host wait of the group is bounded, and a failed communicator is aborted by the rank itself.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0"}
ABORT_BOUND_S = 60.0  # an abort that has not returned by then never will
ABORT_HUNG_EXIT = 5  # exit code of a rank whose NCCL communicator init or abort never returned

# Groups let go of with a collective still in flight, each with that work. A gloo group's destructor
# joins its worker threads, and one blocked in a collective on a peer that is stopped (not dead: its
# sockets stay open) returns only at the collective's timeout: freed here instead, once it has.
_abandoned: list[tuple[object, object]] = []


AllReduce = Callable[[torch.Tensor], None]  # sums a tensor in place across the ranks of a group


BUCKET_BYTES = 4 << 20  # small tensors are summed together in buckets of up to this size


def all_reduce_flat(tensors: list[torch.Tensor], all_reduce: AllReduce, *, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``tensors`` in place across the group. A tensor of ``bucket_bytes`` or more is summed as
    it is; smaller ones are packed into buckets of up to that size (one collective per bucket, not
    per tensor: a drafter's step has dozens of small gradient tensors, each collective a round trip,
    while copying a large tensor into a bucket costs more than its collective saves)."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def flush(members: list[torch.Tensor]) -> None:
        if len(members) == 1:
            all_reduce(members[0])
        elif members:
            flat = torch.cat([t.reshape(-1) for t in members])
            all_reduce(flat)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            all_reduce(tensor)
            continue
        members = buckets.setdefault((tensor.dtype, tensor.device), [])
        if sum(t.numel() * t.element_size() for t in members) + size > bucket_bytes:
            flush(members)
            members.clear()
        members.append(tensor)
    for members in buckets.values():
        flush(members)


class VersionEnded(CollectiveFailed):
    """The dispatcher ended this membership version while the rank waited at its rendezvous."""


class RendezvousIncomplete(CollectiveFailed):
    """Not every rank came to the rendezvous in time; ``arrived`` of them did (this one included)."""

    def __init__(self, message: str, *, arrived: int):
        super().__init__(message)
        self.arrived = arrived


def prepare_nccl_env(environ=os.environ) -> None:
    """Set :data:`NCCL_ENV` before a ProcessGroupNCCL is built (it reads them then); a different value
    set by the user is overridden, and said."""
    for key, value in NCCL_ENV.items():
        if environ.get(key, value) != value:
            log.warning("%s=%s overridden with %s: a data-parallel group aborts a failed communicator itself "
                        "(a watchdog that acts would kill the survivors of a dead rank)", key, environ[key], value)
        environ[key] = value


class StepGroup:
    def __init__(self, *, store: str, rank: int, world_size: int, version: int, timeout_s: float,
                 max_jobs: int, device: torch.device | str = "cpu", rendezvous_timeout_s: float | None = None,
                 still_current: Callable[[], bool] | None = None, server: RendezvousServer | None = None,
                 watch: Callable[[], Callable[[], None]] | None = None):
        """Join membership ``version`` on its ``store`` (a FileStore path, or ``tcp://HOST:PORT/PREFIX``:
        ``server`` when it is this rank's own). Every rank first marks its arrival in the store and
        waits up to ``rendezvous_timeout_s`` (default ``timeout_s``) for all of them, so a rendezvous
        that fails says how many came; only then is the process group opened, its collectives
        bounded by ``timeout_s``. While it waits it asks ``still_current`` every ``WATCH_S``: a
        version the dispatcher ended raises VersionEnded at once. ``watch()``, called as each
        collective's wait begins, gives the check that wait makes as it goes: it raises (VersionEnded,
        or the session's WorkerLost) once the dispatcher says the version ended, and the collective
        is left at once rather than at its timeout."""
        self._still_current = still_current
        self._watch_collective = watch
        _free_abandoned()
        self.rank, self.world_size, self.version = rank, world_size, version
        self.max_jobs = max_jobs  # job ids one rank contributes to a step, at most
        self.timeout_s = timeout_s  # every collective's bound
        self.device = torch.device(device)
        self.broken = False  # a collective failed: the communicator was aborted
        options = {}
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            prepare_nccl_env()
            # gloo for the host's small exchanges, NCCL for device tensors; device_id builds the NCCL
            # communicator now, at the rendezvous, instead of inside the first step's all-reduce
            backend, options = "cpu:gloo,cuda:nccl", {"device_id": self.device}
        else:
            backend = "gloo"
        started = time.monotonic()
        wait_s = rendezvous_timeout_s if rendezvous_timeout_s is not None else timeout_s
        deadline = started + wait_s
        try:
            self._store = self._open_store(store, server, timeout_s=timeout_s, deadline=deadline)
            self._await_ranks(self._store, deadline, wait_s)
            def init() -> None:
                dist.init_process_group(backend, store=self._store, rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout_s), **options)
            if self.device.type == "cuda":  # ncclCommInitRank waits for every rank, without a bound of its own
                call_bounded(init, bound_s=timeout_s, on_overrun=lambda: self._exit_hung("building the NCCL "
                             f"communicator did not return within {timeout_s:g}s (a rank died after it arrived?)"))
            else:
                init()  # gloo's connections are bounded by the store's timeout
        except (RendezvousIncomplete, VersionEnded):
            raise
        except (RuntimeError, ValueError) as exc:  # DistStoreError and friends: the others never came,
            # or rank 0's TCPStore went away with its process (DistNetworkError, at once)
            self._abort()  # a group half built (its NCCL communicator failed to connect) is let go of too
            raise CollectiveFailed(f"rendezvous of membership {version} failed: {exc}") from None
        log.info("rank %d/%d of membership %d joined in %.2fs (%s)", rank, world_size, version,
                 time.monotonic() - started, backend)

    def _open_store(self, name: str, server: RendezvousServer | None, *, timeout_s: float,
                    deadline: float) -> dist.Store:
        tcp = parse_tcp_store(name)
        if tcp is None:
            return dist.FileStore(name, self.world_size)
        host, port, prefix = tcp
        if server is not None and server.address == store_address(host, port):
            base = server.store  # this rank is the version's rank 0
        else:
            self._reach(host, port, deadline)
            base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore(prefix, base)  # the version's own keys: earlier versions' stay apart

    def _reach(self, host: str, port: int, deadline: float) -> None:
        """Wait until rank 0's store accepts connections. One that refuses has not gone for good
        as far as the dispatcher knows: a rank 0 dead on another node stays in its version until its
        heartbeats stop, which ends the version (VersionEnded), as for a rank that never comes.
        (A TCPStore client would retry on its own, logging an error per try.)"""
        while True:
            try:
                with socket.create_connection((host, port), timeout=WATCH_S):
                    return
            except OSError as exc:
                reason = exc
            self._watch(deadline, lambda: RendezvousIncomplete(
                f"rendezvous of membership {self.version}: rank 0's store at {store_address(host, port)} did not "
                f"answer ({reason})", arrived=1))
            time.sleep(WATCH_S)

    def _await_ranks(self, store: dist.Store, deadline: float, timeout_s: float) -> None:
        keys = [f"{ARRIVED_KEY}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], "1")

        def incomplete() -> RendezvousIncomplete:
            arrived = sum(store.check([key]) for key in keys)
            return RendezvousIncomplete(f"rendezvous of membership {self.version}: {arrived} of {self.world_size} "
                                        f"ranks came within {timeout_s:g}s", arrived=arrived)

        watched = time.monotonic()
        while not store.check(keys):  # polled, not waited on: a TCPStore wait that times out logs a warning
            if time.monotonic() >= deadline or time.monotonic() - watched >= WATCH_S:
                self._watch(deadline, incomplete)
                watched = time.monotonic()
            time.sleep(ARRIVAL_POLL_S)

    def _watch(self, deadline: float, incomplete: Callable[[], RendezvousIncomplete]) -> None:
        """While a rank waits at the rendezvous: past ``deadline`` it gives up, and a version the
        dispatcher ended ends its wait at once."""
        if time.monotonic() >= deadline:
            raise incomplete()
        if self._still_current is not None and not self._still_current():
            raise VersionEnded(f"membership {self.version} ended while rank {self.rank} waited at its rendezvous")

    def _run(self, what: str, collective, *args) -> None:
        """``collective(*args)``, its host wait bounded by the timeout and ended early when the
        dispatcher says the version ended; a failure aborts the group."""
        work = None
        try:
            work = collective(*args, async_op=True)
            completed = wait_bounded(work, timeout_s=self.timeout_s,
                                     watch=self._watch_collective() if self._watch_collective is not None else None)
        except VersionEnded as exc:
            self._abort(work)
            raise VersionEnded(f"{what} of membership {self.version} left: {exc}") from None
        except (RuntimeError, ValueError) as exc:  # gloo raises RuntimeError for timeouts and closed peers
            self._abort(work)
            raise CollectiveFailed(f"{what} of membership {self.version} failed: {exc}") from None
        except BaseException:  # the dispatcher forgot this rank (WorkerLost): it registers again
            self._abort(work)
            raise
        if not completed:  # NCCL: the kernel still spins for a peer that is gone
            self._abort(work)
            raise CollectiveFailed(f"{what} of membership {self.version} did not complete within "
                                   f"{self.timeout_s:g}s: a peer is gone (the communicator was aborted)")

    def await_local_compute(self) -> None:
        """Block until the work this rank queued on its compute stream is done (on the CPU it is):
        what the group then waits for is the others and the exchange, not this rank's own backlog."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the group, in place."""
        self._run("all_reduce", dist.all_reduce, tensor)

    def exchange(self, mine: RankRound) -> list[RankRound]:
        """Every rank's round, in rank order: ``[count, done, flush, busy_us, leaving, busy_step, ids...,
        padding]`` per rank."""
        if len(mine.job_ids) > self.max_jobs:
            raise ValueError(f"a rank brings {len(mine.job_ids)} jobs to a step, more than {self.max_jobs}")
        row = torch.full((HEAD + self.max_jobs,), NO_JOB, dtype=torch.int64)  # on the CPU: gloo, read at no cost
        row[:HEAD] = torch.tensor([len(mine.job_ids), int(mine.done), int(mine.flush), mine.busy_us, int(mine.leaving),
                                   mine.busy_step])
        if mine.job_ids:
            row[HEAD:HEAD + len(mine.job_ids)] = torch.tensor(mine.job_ids, dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        self._run("job exchange", dist.all_gather, rows, row)
        rounds = []
        for rank, r in enumerate(rows):
            values = r.tolist()
            rounds.append(RankRound(rank, values[HEAD:HEAD + values[0]], bool(values[1]), bool(values[2]), values[3],
                                    bool(values[4]), values[5]))
        return rounds

    def broadcast(self, *values: int) -> list[int]:
        """Rank 0's ``values`` on every rank (over gloo, on the CPU)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        self._run("broadcast", dist.broadcast, tensor, 0)
        return tensor.tolist()

    def broadcast_tensor(self, tensor: torch.Tensor, source: int = 0) -> None:
        """``tensor`` of rank ``source`` into every rank's ``tensor``, in place."""
        self._run("state broadcast", dist.broadcast, tensor, source)

    def close(self) -> None:
        self._store = None  # a client of rank 0's TCPStore disconnects once the group lets go of it too
        if not dist.is_initialized():
            return
        if self.device.type == "cuda":  # never ncclCommDestroy: it waits for peers that may be gone
            self._abort()
            return
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as exc:  # a broken group may not tear down cleanly
            log.warning("closing the process group of membership %d: %s", self.version, exc)

    def _abort(self, pending: object = None) -> None:
        """Abort every communicator of the group (a spinning NCCL kernel returns) and forget the group,
        on a thread of its own: an abort that does not return within ``ABORT_BOUND_S`` ends the process.
        ``pending``: the collective left in flight, if any; the group is kept, unused, until it ends."""
        self.broken = True
        if not dist.is_initialized():
            return
        _free_abandoned()
        if pending is not None and not pending.is_completed():
            _abandoned.append((dist.group.WORLD, pending))
        done = threading.Event()

        def abort() -> None:
            try:
                _abort_process_group()
            except (RuntimeError, ValueError) as exc:
                log.warning("aborting the process group of membership %d: %s", self.version, exc)
            finally:
                done.set()

        threading.Thread(target=abort, name="hsd-abort-group", daemon=True).start()
        if not done.wait(ABORT_BOUND_S):
            self._exit_hung(f"aborting the communicator did not return within {ABORT_BOUND_S:g}s")

    def _exit_hung(self, what: str) -> None:
        """A call into NCCL that never returns: exit (``ABORT_HUNG_EXIT``); the launcher restarts this rank,
        which joins again: a lost process, never a hung group."""
        log.error("rank %d of membership %d: %s; exiting (the launcher restarts this rank, which joins again)",
                  self.rank, self.version, what)
        logging.shutdown()
        os._exit(ABORT_HUNG_EXIT)


@atexit.register
def _leak_abandoned_at_exit() -> None:
    """The groups still abandoned when the process exits are leaked, not destroyed: each destructor
    would hold the exit until its collective's timeout."""
    for entry in _abandoned:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry))


def _free_abandoned() -> None:
    """Let go of the abandoned groups whose collective has ended (it failed at its timeout, or the
    peer came back and completed it): their destructors no longer wait."""
    _abandoned[:] = [(group, work) for group, work in _abandoned if not work.is_completed()]
