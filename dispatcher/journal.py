"""The run journal: append-only, checksummed JSON lines in the run directory.

Every event that changes what a restart must know (the dispatcher started, an epoch started, a
step committed, a model rolled back or checkpointed) is appended and fsynced before the dispatcher
acknowledges it. Progress events (a job ready, a worker joined) are buffered and flushed a few times
a second without fsync: the report reads them, a restart does not need them.

The line format, the segments and the one reader are ``common/run/records/journal.py``'s; this is
the writer. It cuts the *torn tail* on open, the bytes after the live segment's last newline (a
power cut or a full disk mid-write: never acknowledged, since a record is acknowledged only once its
newline is on disk), so the next record never glues onto it; any other damaged line is left for the
reader's rule (docs/corruption.md). A write or fsync that fails stops the dispatcher (fail closed):
what was not durable was never acknowledged, and nothing more is written after the failure.

A snapshot of the ledger (``dispatcher/recovery.py``) closes the live segment ``journal.jsonl`` as
``journal-NNNNNN.jsonl``, so a restart replays only the segments after the latest snapshot.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

from common import faults
from common.run.durable import StorageFailed, fsync_dir
from common.run.records.events import Event
from common.run.records.journal import JOURNAL_NAME, encode_event
from common.thread_name import name_os_thread

log = logging.getLogger("hsd.journal")

# Background mode: the thread is woken to write once this many lines are queued, even with no
# durable one among them, so the queue stays small between the loop's flushes.
QUEUE_WAKE_LINES = 1024
SYNC_THREAD_NAME = "hsd-journal"  # the sync thread, as profiles and hsd bench scale's CPU by thread name it


class JournalFailed(StorageFailed):
    """The journal could not be made durable: the dispatcher must stop."""


def repair_tail(path: Path) -> int:
    """Cut the torn tail of ``path``, the bytes after its last newline; returns the number cut.

    Only that is ever cut: a record is acknowledged once its newline is on disk, so an unterminated
    one never was. A damaged line before the last newline stays for the readers' policy."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # back from the end, a block at a time, to the last newline
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
    if end < size:
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
        log.warning("journal %s: cut a torn tail of %d bytes after the last newline (a record cut short by a "
                    "crash or a full disk; never acknowledged)", path, size - end)
    return size - end


class Journal:
    """Append-only writer. With ``sync_in_background`` a thread of its own writes the lines and
    fsyncs the durable ones, so the dispatcher's loop never waits on the disk: an fsync can take
    tens of milliseconds on a shared filesystem, and while it runs even a plain append to the file
    blocks (the tail page is under writeback). The loop only queues encoded lines in memory; it
    holds back each reply that needs durability until ``synced_seq`` reaches it, and ``notify_fd``
    becomes readable whenever a sync completes or fails.

    Lines are queued in memory and written with one unbuffered write each time (inline mode: with a
    durable record, a flush, a rotation or a close), so a write the disk refuses leaves no bytes
    in a buffer to be written later behind a partial line: after a failure nothing more is written,
    and the partial line is the torn tail the next open cuts."""

    def __init__(self, run_dir: str | os.PathLike, *, sync_in_background: bool = False):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / JOURNAL_NAME
        repair_tail(self.path)
        self._file = open(self.path, "ab", buffering=0)
        self._io = threading.Lock()    # the file object: the sync thread, rotate() and close()
        self._lock = threading.Lock()  # the queue of lines and the counters, between the loop and the thread
        self._queue: list[bytes] = []  # lines recorded, not yet written
        # background mode: segments closed by rotate(), not yet written, fsynced and renamed by the thread
        self._closing: list[tuple[int, list[bytes], int]] = []  # (segment, its last lines, durable seq)
        self._rotated = threading.Condition()
        self.rotated_segment = -1  # the last segment on disk under its archived name
        self.written_seq = 0  # durable events recorded so far
        self.synced_seq = 0   # ... of which fsynced
        self.failed: BaseException | None = None
        self.num_lines = 0    # lines in the current segment (recorded by this process)
        self._fsyncs_left = faults.journal_fsyncs_allowed()  # a test fault: None in a real run
        self._writes_left = faults.disk_full_after("journal")  # a test fault: None in a real run
        self._syncer: threading.Thread | None = None
        if sync_in_background:
            self.notify_fd, self._notify_w = os.pipe()
            os.set_blocking(self.notify_fd, False)
            self._wake = threading.Event()
            self._stopping = False
            self._syncer = threading.Thread(target=self._sync_loop, name="journal-sync", daemon=True)
            self._syncer.start()

    def _fsync(self) -> None:
        if self._fsyncs_left is not None:
            if self._fsyncs_left <= 0:
                raise OSError(errno.EIO, f"fsync failed (injected by {faults.ENV})")
            self._fsyncs_left -= 1
        os.fsync(self._file.fileno())

    def _write(self, data: bytes) -> None:
        """All of ``data`` to the file (an unbuffered write may take part of it), or OSError."""
        if self._writes_left is not None:
            if self._writes_left <= 0:
                half = data[:len(data) // 2]  # what a disk that fills mid-write keeps: a partial line
                self._file.write(half)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected by {faults.ENV})")
            self._writes_left -= 1
        view = memoryview(data)
        while view:
            view = view[self._file.write(view):]

    def _failure(self, exc: OSError) -> JournalFailed:
        self.failed = exc
        return JournalFailed(self.path, exc, action="writing the journal")

    def record(self, event: Event, *, durable: bool = False) -> None:
        """Append one event, stamped with the time (unless it has one). A ``durable`` one is on disk
        when this returns, or (background sync) once ``synced_seq`` reaches the ``written_seq`` it
        got; the others by the next :meth:`flush` (the dispatcher flushes a few times a second)."""
        if self.failed is not None:
            raise JournalFailed(self.path, self.failed, action="writing the journal (failed earlier)")
        if not event.t:
            event.t = time.time_ns() // 1000 / 1e6  # to the microsecond (round(t, 6) costs a microsecond)
        line = encode_event(event)
        with self._lock:
            self._queue.append(line)
            self.num_lines += 1
            if durable:
                self.written_seq += 1
            write_now = durable or len(self._queue) >= QUEUE_WAKE_LINES
        if not write_now:
            return
        if self._syncer is not None:
            if not self._wake.is_set():
                self._wake.set()
            return
        with self._io:
            try:
                target = self._write_queued()
                if durable:
                    self._fsync()
            except OSError as exc:
                raise self._failure(exc) from exc
            if durable:
                self.synced_seq = target

    @property
    def unsynced(self) -> bool:
        return self.synced_seq < self.written_seq

    def _write_queued(self) -> int:
        """Write what is queued (caller holds ``_io``); returns the durable sequence it covers."""
        with self._lock:
            lines, self._queue = self._queue, []
            target = self.written_seq
        if lines:
            self._write(b"".join(lines))
        return target

    def _sync_loop(self) -> None:
        name_os_thread(SYNC_THREAD_NAME)
        while True:
            self._wake.wait()
            self._wake.clear()
            stopping = self._stopping
            synced = False
            try:
                with self._io:  # held through the fsync: rotate() must not split a write from its segment
                    with self._lock:  # one cut: closed segments' lines, then the lines recorded after them
                        closing, self._closing = self._closing, []
                        lines, self._queue = self._queue, []
                        target = self.written_seq
                    for segment, segment_lines, segment_target in closing:
                        self._close_segment(segment, segment_lines, segment_target)
                        synced = True
                    if lines:
                        self._write(b"".join(lines))
                    if target > self.synced_seq:
                        self._fsync()
                        self.synced_seq = target
                        synced = True
            except OSError as exc:
                self.failed = exc
                with self._rotated:
                    self._rotated.notify_all()
                os.write(self._notify_w, b"f")
                return
            if synced:
                os.write(self._notify_w, b"s")
            if stopping:
                return

    def drain_notifications(self) -> None:
        try:
            while os.read(self.notify_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def flush(self) -> None:
        """Hand the lines recorded so far to the OS (background mode: ask the thread to, without waiting)."""
        if self._syncer is not None:
            self._wake.set()
            return
        if self.failed is not None:
            return
        with self._io:
            try:
                self._write_queued()
            except OSError as exc:
                raise self._failure(exc) from exc

    def rotate(self, segment: int) -> None:
        """Close the current segment as ``journal-<segment>.jsonl`` (durably) and start a new one.

        Background mode: the cut is made here (every line recorded so far is the closing segment's),
        and the thread writes, fsyncs and renames it, so the loop never waits on the disk;
        :meth:`wait_rotated` blocks until the segment is on disk under its name."""
        if self._syncer is not None:
            with self._lock:
                self._closing.append((segment, self._queue, self.written_seq))
                self._queue = []
                self.num_lines = 0
            self._wake.set()
            return
        with self._io:
            with self._lock:
                lines, self._queue = self._queue, []
            try:
                self._close_segment(segment, lines, self.written_seq)
            except OSError as exc:
                raise self._failure(exc) from exc
            self.num_lines = 0

    def _close_segment(self, segment: int, lines: list[bytes], target: int) -> None:
        """Write ``lines``, fsync, archive the file as segment ``segment`` and open the next (caller holds ``_io``)."""
        if lines:
            self._write(b"".join(lines))
        self._fsync()
        self._file.close()
        os.replace(self.path, self.run_dir / f"journal-{segment:06d}.jsonl")
        self._file = open(self.path, "ab", buffering=0)
        fsync_dir(self.run_dir)
        self.synced_seq = max(self.synced_seq, target)
        with self._rotated:
            self.rotated_segment = segment
            self._rotated.notify_all()

    def wait_rotated(self, segment: int) -> None:
        """Block until segment ``segment`` is durable under its archived name (a snapshot that covers
        it may be published only then); raises JournalFailed if the journal failed first."""
        with self._rotated:
            while self.rotated_segment < segment:
                if self.failed is not None:
                    raise JournalFailed(self.path, self.failed,
                                        action=f"closing segment {segment} of the journal")
                self._rotated.wait(timeout=1.0)

    def close(self) -> None:
        """Write and fsync what is queued, and close; never raises. After a failure (now or before)
        nothing more is written: ``failed`` says so, and what was queued was never acknowledged."""
        if self._syncer is not None:
            self._stopping = True
            self._wake.set()
            self._syncer.join()
            self._syncer = None
            os.close(self.notify_fd)
            os.close(self._notify_w)
        with self._io:
            if self._file.closed:
                return
            if self.failed is None:
                try:
                    target = self._write_queued()
                    self._fsync()
                    self.synced_seq = target
                except OSError as exc:
                    self.failed = exc
            try:
                self._file.close()
            except OSError as exc:
                self.failed = self.failed or exc
