"""The run journal: append-only, checksummed JSON lines in the run directory.

Every event that changes what a restart must know (the dispatcher started, an epoch started, a
step committed, a model rolled back or checkpointed) is appended and fsynced before the dispatcher
acknowledges it. Progress events (a job ready, a worker joined) are buffered and flushed a few times
a second without fsync: the report reads them, a restart does not need them.

Each event is a struct of ``dispatcher/journal_events.py``, and each line ``<crc32 of the JSON, 8 hex
digits> <JSON>``, the JSON msgspec's encoding of the struct. What is damaged is told apart by
one rule (docs/corruption.md): the *torn tail*, bytes after the live segment's last newline (a power
cut or a full disk mid-write: never acknowledged, since a record is acknowledged only once its
newline is on disk), is cut on open, so the next record never glues onto it. Any other damaged line
is never cut and never skipped silently: a reader skips it, naming its file and line, only when
its kind can still be read and is one that no restart needs (a progress event); otherwise it
raises :class:`JournalDamaged`, naming the file and line. A write or fsync that fails stops the
dispatcher (fail closed): what was not durable was never acknowledged, and nothing more is written
after the failure.

The journal is a sequence of segments: ``journal.jsonl`` is the one being written; a snapshot of
the ledger (``dispatcher/recovery.py``) closes it as ``journal-NNNNNN.jsonl``, so a restart
replays only the segments after the latest snapshot.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator

import msgspec

from common import faults
from common.run.durable import StorageFailed, fsync_dir
from dispatcher.journal_events import KINDS, KINDS_A_RESTART_NEEDS, AnyEvent, Event, kind_of

log = logging.getLogger("hsd.journal")

JOURNAL_NAME = "journal.jsonl"
_SEGMENT = re.compile(r"^journal-(\d{6})\.jsonl$")
# Background mode: the thread is woken to write once this many lines are queued, even with no
# durable one among them, so the queue stays small between the loop's flushes.
QUEUE_WAKE_LINES = 1024


class JournalFailed(StorageFailed):
    """The journal could not be made durable: the dispatcher must stop."""


class JournalCorrupt(ValueError):
    """An intact line (its checksum holds) whose event does not decode: a dispatcher's bug, never skipped."""


class JournalDamaged(ValueError):
    """A damaged line (its checksum fails) that is not the torn tail and may hold a record a reader needs."""

    def __init__(self, path: Path, line: int, kind: str | None):
        self.path, self.line, self.kind = path, line, kind
        held = f"a {kind!r} record" if kind else "a record whose kind cannot be read"
        super().__init__(
            f"journal {path}, line {line}: damaged ({held}; its checksum does not match). It may be an acknowledged "
            "commit, so it is neither cut nor skipped. Restore this file from a copy, or start the run again in a "
            "new run.dir (docs/corruption.md)")


class UnknownKind(ValueError):
    """A line of a kind this dispatcher does not know (an older or a newer one wrote it)."""

    def __init__(self, kind: str):
        super().__init__(f"unknown journal event kind {kind!r}")
        self.kind = kind


class _Kind(msgspec.Struct):
    ev: str


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)
_kind_decoder = msgspec.json.Decoder(_Kind)


def encode_event(event: Event) -> bytes:
    """The journal line of ``event``: its JSON (fields in the struct's order) after the JSON's crc32."""
    body = _encoder.encode(event)
    # the crc as 8 hex digits: bytes.hex is cheaper than %-formatting bytes, on every journaled op
    return zlib.crc32(body).to_bytes(4, "big").hex().encode() + b" " + body + b"\n"


def intact_body(line: bytes) -> bytes | None:
    """The JSON of a whole, intact line; None for a torn or corrupt one."""
    if len(line) < 11 or not line.endswith(b"\n") or line[8:9] != b" " or line[9:10] != b"{":
        return None
    body = line[9:-1]
    try:
        return body if int(line[:8], 16) == zlib.crc32(body) else None
    except ValueError:
        return None


def decode_event(body: bytes) -> AnyEvent:
    """The event of an intact line's JSON. Raises UnknownKind for a kind this dispatcher does not know,
    JournalCorrupt for a known kind whose fields do not fit it."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        doc: object = body
        error: Exception = exc
    except msgspec.DecodeError:  # not the JSON msgspec reads: NaN or Infinity, as json.dumps wrote them
        doc = None
        try:
            doc = json.loads(body)
            return msgspec.convert(doc, AnyEvent)
        except (ValueError, msgspec.ValidationError) as exc:
            error = exc
    try:
        kind = (_kind_decoder.decode(doc) if isinstance(doc, bytes) else msgspec.convert(doc, _Kind)).ev
    except (msgspec.DecodeError, msgspec.ValidationError):
        kind = None
    if kind is not None and kind not in KINDS:
        raise UnknownKind(kind)
    raise JournalCorrupt(f"a {kind or 'nameless'} record that does not decode: {error}")


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


_KIND_AT_START = re.compile(rb'^[0-9a-f]{8} \{"ev":"([a-z_]+)"')


def kind_of_damaged(line: bytes) -> str | None:
    """The kind a damaged line still shows, or None when it cannot be told: its kind field must be
    whole, name a known kind, and be the line's only one (a lost newline glues two records)."""
    match = _KIND_AT_START.match(line)
    if match is None or line.count(b'"ev":') != 1:
        return None
    kind = match.group(1).decode()
    return kind if kind in KINDS else None


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


def segment_paths(run_dir: str | os.PathLike, *, after: int = -1) -> list[Path]:
    """The journal's segments in order: archived ones numbered above ``after``, then the current one."""
    run_dir = Path(run_dir)
    archived = []
    if run_dir.is_dir():
        for name in os.listdir(run_dir):
            match = _SEGMENT.match(name)
            if match and int(match.group(1)) > after:
                archived.append((int(match.group(1)), run_dir / name))
    paths = [path for _, path in sorted(archived)]
    current = run_dir / JOURNAL_NAME
    if current.exists():
        paths.append(current)
    return paths


def archived_segment_numbers(run_dir: str | os.PathLike) -> list[int]:
    if not Path(run_dir).is_dir():
        return []
    return sorted(int(m.group(1)) for m in map(_SEGMENT.match, os.listdir(run_dir)) if m)


def last_segment_number(run_dir: str | os.PathLike) -> int:
    return max(archived_segment_numbers(run_dir), default=-1)


def read_journal(run_dir: str | os.PathLike, *, after: int = -1, only: tuple[type[Event], ...] | None = None,
                 damaged: list[tuple[Path, int, str]] | None = None) -> Iterator[AnyEvent]:
    """Every intact event of the journal's segments after ``after``, in order, streamed.

    ``only``: the event types wanted; the others are skipped before their JSON is decoded (a restart
    needs a few kinds of millions). A record of a kind this dispatcher does not know is skipped, and
    logged once per kind and read; one of a known kind that does not decode raises JournalCorrupt.
    A damaged line follows the module's rule: skipped, logged and added to ``damaged`` as (file,
    line, kind) when its kind can be read and is not one a restart needs (or not one asked for);
    else JournalDamaged. The live segment's unterminated last line (torn, or being written) is not
    a record yet: passed over."""
    wanted = frozenset(kind_of(cls) for cls in only) if only else None
    unknown: set[str] = set()
    for path in segment_paths(run_dir, after=after):
        yield from read_segment(path, wanted=wanted, only=only, damaged=damaged, unknown=unknown)


def read_segment(path: Path, *, wanted: frozenset[str] | None, only: tuple[type[Event], ...] | None,
                 damaged: list[tuple[Path, int, str]] | None, unknown: set[str]) -> Iterator[AnyEvent]:
    """One segment's events, by :func:`read_journal`'s rules (``wanted``: the kinds of ``only``)."""
    needles = tuple(b'"ev":"%s"' % kind.encode() for kind in wanted) if wanted else None
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if needles is not None and not any(n in line[9:40] for n in needles):
                if intact_body(line) is None and line.endswith(b"\n"):  # damaged: is it one we need?
                    _pass_damaged(path, number, line, wanted, damaged)
                continue
            body = intact_body(line)
            if body is None:
                if line.endswith(b"\n"):
                    _pass_damaged(path, number, line, wanted, damaged)
                continue
            try:
                event = decode_event(body)
            except UnknownKind as exc:
                if exc.kind not in unknown:
                    unknown.add(exc.kind)
                    log.warning("journal %s:%d: skipped a record of unknown kind %r (an older or newer "
                                "dispatcher wrote it); the later ones of that kind are skipped too",
                                path, number, exc.kind)
                continue
            except JournalCorrupt as exc:
                raise JournalCorrupt(f"journal {path}:{number}: {exc}") from None
            if only is None or isinstance(event, only):
                yield event


def last_event(run_dir: str | os.PathLike, kind: type[Event]) -> AnyEvent | None:
    """The journal's last event of ``kind``, read from the newest segment back, so a damaged line in
    an older segment than the one that holds it is never read."""
    wanted = frozenset({kind_of(kind)})
    for path in reversed(segment_paths(run_dir)):
        found = list(read_segment(path, wanted=wanted, only=(kind,), damaged=None, unknown=set()))
        if found:
            return found[-1]
    return None


def _pass_damaged(path: Path, number: int, line: bytes, wanted: frozenset[str] | None,
                  damaged: list[tuple[Path, int, str]] | None) -> None:
    """A damaged line a reader may pass over (logged, and listed in ``damaged``), or JournalDamaged."""
    kind = kind_of_damaged(line)
    if kind is None or (kind in KINDS_A_RESTART_NEEDS and (wanted is None or kind in wanted)):
        raise JournalDamaged(path, number, kind)
    log.warning("journal %s:%d: skipped a damaged %r record (its checksum does not match; %s)", path, number, kind,
                "a progress event no restart needs" if kind not in KINDS_A_RESTART_NEEDS else "not one this reader reads")
    if damaged is not None:
        damaged.append((path, number, kind))
