"""A run's epochs on disk and in memory: schedules, the builder, snapshots and sealing.

``EpochStore`` decides nothing about jobs (that is the ledger's and the core's business); it keeps
what every epoch needs on disk and in memory over the epoch's life:

- *built*: the schedule builder (a child process) writes the next epoch's schedule ahead of time;
- *started*: the schedule is memory-mapped, its jobs enter the ledger, the journal records it;
- *finished* (every job committed): the schedule is dropped and a snapshot is due;
- *sealed*: once a snapshot holds the finished epoch, its ledger arrays become read-only mappings of
  the snapshot's files, and later snapshots hard-link them instead of copying.

Snapshots close a journal segment, so a restart reads the latest snapshot and replays only the
segments after it (``dispatcher/recovery.py``).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Callable

import numpy as np

from common.run.durable import StorageFailed
from common.run.records.events import EpochStarted
from common.run.records.journal import last_segment_number
from common.run.records.rundir import LENGTHS_FILE, write_run_lengths
from common.run.records.schedule import EpochSchedule, load_schedule
from dispatcher.journal import Journal
from dispatcher.ledger import JobLedger
from dispatcher.recovery import ModelRecord, Recovered, Snapshot, SnapshotWriter, map_arrays, snapshot_root
from dispatcher.schedule_builder import ScheduleBuilder, ScheduleSpec

log = logging.getLogger("hsd.dispatcher")

# A snapshot of the ledger closes the journal segment once it holds this many lines (and whenever an
# epoch completes), so a restart never replays more than about this many.
SNAPSHOT_EVERY_LINES = 200_000
DATA_FINGERPRINT_FILE = "data_fingerprint"


def check_data(run_dir: Path, lengths: np.ndarray, *, allow_changed: bool) -> None:
    """A resume must train on the data its schedules were drawn from: refused unless allowed.

    Writes the lengths the schedule builder reads, and their fingerprint, on a first start."""
    fingerprint = hashlib.sha256(lengths.astype("<i8").tobytes()).hexdigest()
    path = run_dir / DATA_FINGERPRINT_FILE
    if path.exists():
        previous = path.read_text().strip()
        if previous != fingerprint:
            if not allow_changed:
                raise ValueError(f"{run_dir} was started on other data (fingerprint {previous[:12]}, now "
                                 f"{fingerprint[:12]}): its schedules index the old samples. Use a new run.dir, "
                                 f"or set data.allow_changed=true to resume anyway")
            log.warning("resuming on changed data (data.allow_changed=true): fingerprint %s -> %s",
                        previous[:12], fingerprint[:12])
    if not path.exists() or path.read_text().strip() != fingerprint or not (run_dir / LENGTHS_FILE).exists():
        write_run_lengths(run_dir, lengths)
        path.write_text(fingerprint + "\n")


class EpochStore:
    def __init__(self, run_dir: Path, spec: ScheduleSpec, num_epochs: int, ledger: JobLedger, journal: Journal, *,
                 build_ahead: bool):
        self.run_dir = run_dir
        self.num_epochs = num_epochs
        self.ledger = ledger
        self.journal = journal
        self.schedules: dict[int, EpochSchedule] = {}  # open epochs (memory-mapped); finished ones are dropped
        self.epoch_jobs: dict[int, int] = {}           # every started epoch -> its job count
        self.deviation: dict[int, float] = {}          # each schedule's prefix deviation (computed when built)
        self.builder = ScheduleBuilder(run_dir, spec, inline=not build_ahead)
        self.snapshots = SnapshotWriter(run_dir)
        self.snapshot_due = False
        self._segment = -1
        self._snapshot_dir: Path | None = None  # the latest snapshot written: sealed epochs' arrays live there

    # -- restart ----------------------------------------------------------------------------
    def restore(self, recovered: Recovered) -> None:
        """Every started epoch back in the ledger, with the commits the snapshot holds (the journal's
        later events are the core's to replay; then :meth:`settle`)."""
        snapshot = recovered.snapshot
        if snapshot is not None:
            self._segment = snapshot.segment
        # a segment archived after that snapshot (its own snapshot never published: the dispatcher
        # died between the two) was replayed; the next segment takes a new number, never its
        self._segment = max(self._segment, last_segment_number(self.run_dir))
        for epoch in sorted(recovered.epochs_started):
            schedule = load_schedule(self.run_dir, epoch)
            if schedule is None:
                raise ValueError(f"the journal names epoch {epoch} but its schedule is missing in {self.run_dir} "
                                 "(restore it from a copy, or start the run again in a new run.dir)")
            self._add(schedule)
            if snapshot is not None and epoch in snapshot.commit_step:
                self.ledger.restore_arrays(epoch, snapshot.commit_step[epoch], snapshot.commit_model[epoch])

    def settle(self, recovered: Recovered) -> None:
        """After the replay: finished epochs drop their schedules, and those the replay left as the
        snapshot holds them are sealed at once; then the first epoch starts, or the next one builds."""
        for epoch in list(self.schedules):
            self.finish_if_complete(epoch)
        if recovered.snapshot is not None:
            self._snapshot_dir = recovered.snapshot_path
            for epoch in recovered.snapshot.commit_step:
                self._seal_if_unchanged(epoch, 0)
        if not self.epoch_jobs:
            self.builder.wait(0)
            self.start(0)
        else:
            self._request_next_build()

    # -- the epoch's life -------------------------------------------------------------------
    def _add(self, schedule: EpochSchedule) -> None:
        self.ledger.add_epoch(schedule.epoch, schedule.job_bucket)
        self.schedules[schedule.epoch] = schedule
        self.epoch_jobs[schedule.epoch] = schedule.num_jobs
        self.deviation[schedule.epoch] = schedule.prefix_deviation

    def start(self, epoch: int) -> None:
        schedule = load_schedule(self.run_dir, epoch)
        assert schedule is not None, "the builder wrote it"
        self._add(schedule)
        self.journal.record(EpochStarted(epoch=epoch, jobs=schedule.num_jobs,
                                         buckets=[b.num_batches for b in schedule.buckets]), durable=True)
        self._request_next_build()

    def _request_next_build(self) -> None:
        following = max(self.epoch_jobs) + 1
        if following < self.num_epochs:
            self.builder.request(following)

    def maybe_start_next(self) -> None:
        """Start the next epoch once nothing of the current ones is pending and its schedule is built."""
        if self.ledger.num_pending:
            return
        following = max(self.epoch_jobs) + 1
        if following < self.num_epochs and self.builder.ready(following):
            self.start(following)

    def schedule(self, epoch: int) -> EpochSchedule:
        """An epoch's schedule, mapped again if the epoch had finished (a rollback reopened it)."""
        schedule = self.schedules.get(epoch)
        if schedule is None:
            schedule = load_schedule(self.run_dir, epoch)
            assert schedule is not None
            self.schedules[epoch] = schedule
        return schedule

    def finish_if_complete(self, epoch: int) -> None:
        """A finished epoch drops its schedule; the next snapshot takes its arrays, then it is sealed."""
        if self.ledger.epoch_complete(epoch) and epoch in self.schedules:
            del self.schedules[epoch]
            self.snapshot_due = True

    @property
    def all_committed(self) -> bool:
        # the ledger holds exactly the started epochs (start() adds each to both)
        return len(self.epoch_jobs) == self.num_epochs and self.ledger.all_committed

    def open_epochs(self) -> list[int]:
        return self.ledger.open_epochs()  # the ledger holds exactly the started epochs

    @property
    def jobs_per_epoch(self) -> int:
        """The job count of an epoch: the first started one's, as every epoch's schedule makes as many
        (:func:`common.run.records.schedule.count_batches`). A drafter's register reply carries it."""
        return self.epoch_jobs[min(self.epoch_jobs)]

    # -- snapshots and sealing --------------------------------------------------------------
    def maybe_snapshot(self, models: Callable[[], dict[str, ModelRecord]], num_starts: int, *,
                       force: bool = False) -> bool:
        """Close the journal segment and snapshot the ledger when it is due; the write runs on a thread.
        ``models``: what the snapshot keeps of each model, asked only when one is taken.

        Only epochs not yet sealed are copied (on the loop: the open ones, and a finished one once);
        sealed epochs are hard-linked from the previous snapshot. When a write is done, the finished
        epochs it holds are sealed.
        """
        error = self.snapshots.error
        if error is not None:
            if isinstance(error, StorageFailed):
                raise error
            if isinstance(error, OSError):  # the disk refused it: the same fail-closed stop as the journal's
                raise StorageFailed(error.filename or snapshot_root(self.run_dir), error,
                                    action="writing the ledger snapshot") from error
            raise RuntimeError(f"writing a ledger snapshot failed: {error!r}") from error
        if self.snapshots.busy:
            return False
        self._seal_written()
        if not (force or self.snapshot_due or self.journal.num_lines >= SNAPSHOT_EVERY_LINES):
            return False
        self._segment += 1
        epochs = self.ledger.epochs
        copied = {e: p for e, p in epochs.items() if not p.sealed}
        snapshot = Snapshot(
            segment=self._segment, num_starts=num_starts, epochs_started=sorted(self.epoch_jobs), models=models(),
            commit_step={e: p.commit_step.copy() for e, p in copied.items()},
            commit_model={e: p.commit_model.copy() for e, p in copied.items()},
            linked={e: self._snapshot_dir for e, p in epochs.items() if p.sealed},
            versions={e: p.version for e, p in copied.items()})
        segment = self._segment
        self.journal.rotate(segment)  # the cut is here; the journal's thread puts the segment on disk
        self.snapshots.submit(snapshot, before_publish=lambda: self.journal.wait_rotated(segment))
        self.snapshot_due = False
        return True

    def wait_for_snapshot(self) -> None:
        """Block until the snapshot being written is on disk, then seal what it holds."""
        self.snapshots.wait()
        self._seal_written()

    def _seal_written(self) -> None:
        written = self.snapshots.take_written()
        if written is None:
            return
        snapshot, self._snapshot_dir = written
        for epoch, version in snapshot.versions.items():
            self._seal_if_unchanged(epoch, version)

    def _seal_if_unchanged(self, epoch: int, version: int) -> None:
        """Seal a finished epoch whose arrays the latest snapshot holds at ``version``: its memory goes."""
        progress = self.ledger.epochs[epoch]
        if progress.sealed or progress.version != version or not self.ledger.epoch_complete(epoch):
            return
        schedule = load_schedule(self.run_dir, epoch)
        assert schedule is not None, "a started epoch's schedule exists"
        self.ledger.seal_epoch(epoch, *map_arrays(self._snapshot_dir, epoch), schedule.job_bucket)

    def close(self) -> None:
        self.snapshots.wait()
        self.builder.close()
