"""Checkpoints written off the training thread: at most one in flight.

A loop takes a :class:`common.run.witness.CheckpointSnapshot` at a step boundary (host copies of the
state, :mod:`common.dataplane.host_staging`) and hands it to :meth:`CheckpointWriter.start`; a thread writes
and fsyncs it (:func:`common.run.witness.save_checkpoint`: a temporary directory renamed into place,
then ``latest``) while training goes on. :meth:`CheckpointWriter.poll` hands the loop each
checkpoint once it is durable, and only then does the loop send ``checkpoint {model, step}``: the
dispatcher hears of a checkpoint only when a crash can no longer lose it. A process killed
mid-write leaves the previous checkpoint as ``latest`` (the half-written directory is a temporary
one, removed by the next checkpoint).

At most one checkpoint is in flight. A checkpoint due while the previous one is still being
written waits for it (:meth:`wait`) before its snapshot is taken, rather than being skipped: every
``drafter.checkpoint_every`` steps still gets its checkpoint, and one host copy of the state
exists at a time. The wait costs training time only when writing a checkpoint takes longer than
``checkpoint_every`` steps.

Two test-only faults (:mod:`common.faults`), read at start: ``checkpoint_delay_s`` makes every
write pause that long with its files on disk before it is published, and
``checkpoint_exit_at_step=N`` kills the process at that point of the write of step N.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from common import faults
from common.run.durable import StorageFailed, is_storage_error
from common.run.witness import Checkpoint, CheckpointSnapshot

log = logging.getLogger("hsd.checkpoint")


class CheckpointWriteFailed(RuntimeError):
    """The background write failed (a full disk, an I/O error): the worker stops, as a write on the
    training thread would have stopped it."""


class CheckpointWriter:
    def __init__(self, run_dir: str | os.PathLike, *, name: str = ""):
        self.run_dir = Path(run_dir)
        self.name = name
        # Runs on the writer thread once the files are on disk, before the rename (tests pause or kill there).
        self.before_publish: Callable[[Path, int], None] | None = faults.checkpoint_before_publish()
        self._thread: threading.Thread | None = None
        self._in_flight: CheckpointSnapshot | None = None
        self._durable: Checkpoint | None = None  # written, not yet handed out by poll() or wait()
        self._error: BaseException | None = None
        self._write_s = 0.0

    @property
    def in_flight_step(self) -> int | None:
        return self._in_flight.step if self._in_flight is not None else None

    def start(self, snapshot: CheckpointSnapshot) -> None:
        """Write ``snapshot`` on a thread. The previous write must be over (:meth:`wait`)."""
        assert self._thread is None, "one checkpoint in flight at a time: wait() for the previous one first"
        self._in_flight = snapshot
        self._thread = threading.Thread(target=self._write, args=(snapshot,), name=f"checkpoint-{snapshot.step}",
                                        daemon=True)
        self._thread.start()

    def poll(self) -> Checkpoint | None:
        """The checkpoint that became durable since the last call, if any (never blocks)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()
        return self._take()

    def wait(self) -> Checkpoint | None:
        """Block until no write is in flight; the checkpoint that became durable, if not handed out yet."""
        if self._thread is not None:
            self._join()
        return self._take()

    # -- the thread -----------------------------------------------------------------------------
    def _write(self, snapshot: CheckpointSnapshot) -> None:
        started = time.perf_counter()
        try:
            hook = self.before_publish
            self._durable = snapshot.write(self.run_dir, before_publish=(lambda tmp: hook(tmp, snapshot.step))
                                           if hook is not None else None)
        except BaseException as exc:  # handed to the training thread by poll()/wait()
            self._error = exc
        self._write_s = time.perf_counter() - started

    def _join(self) -> None:
        assert self._thread is not None and self._in_flight is not None
        self._thread.join()
        step = self._in_flight.step
        self._thread, self._in_flight = None, None
        if self._error is not None:
            error, self._error = self._error, None
            if is_storage_error(error):  # a full disk: the fail-closed stop, one line naming the path
                raise StorageFailed(getattr(error, "filename", None) or self.run_dir, error,
                                    action=f"{self.name}: writing the checkpoint of step {step} at") from error
            raise CheckpointWriteFailed(f"{self.name}: writing the checkpoint of step {step} failed: {error}") from error
        log.info("%s: checkpoint of step %d durable after %.2f s of writing beside training", self.name, step,
                 self._write_s)

    def _take(self) -> Checkpoint | None:
        durable, self._durable = self._durable, None
        return durable
