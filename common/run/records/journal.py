"""The run journal's format and its one reader: checksummed JSON lines in the run directory.

Each event is a struct of ``common/run/records/events.py``, and each line ``<crc32 of the JSON, 8 hex
digits> <JSON>``, the JSON msgspec's encoding of the struct. What is damaged is told apart by one
rule (docs/corruption.md): the *torn tail*, bytes after the live segment's last newline (a power cut
or a full disk mid-write: never acknowledged, since a record is acknowledged only once its newline is
on disk), is cut by the writer on open (``dispatcher/journal.py``), so the next record never glues
onto it. Any other damaged line is never cut and never skipped silently: a reader skips it, naming
its file and line, only when its kind can still be read and is one that no restart needs (a progress
event); otherwise it raises :class:`JournalDamaged`, naming the file and line.

The journal is a sequence of segments: ``journal.jsonl`` is the one being written; a snapshot of
the ledger (``dispatcher/recovery.py``) closes it as ``journal-NNNNNN.jsonl``, so a restart
replays only the segments after the latest snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Iterator

import msgspec

from common.run.records.events import KINDS, KINDS_A_RESTART_NEEDS, AnyEvent, Event, kind_of

log = logging.getLogger("hsd.journal")

JOURNAL_NAME = "journal.jsonl"
_SEGMENT = re.compile(r"^journal-(\d{6})\.jsonl$")


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


_KIND_AT_START = re.compile(rb'^[0-9a-f]{8} \{"ev":"([a-z_]+)"')


def kind_of_damaged(line: bytes) -> str | None:
    """The kind a damaged line still shows, or None when it cannot be told: its kind field must be
    whole, name a known kind, and be the line's only one (a lost newline glues two records)."""
    match = _KIND_AT_START.match(line)
    if match is None or line.count(b'"ev":') != 1:
        return None
    kind = match.group(1).decode()
    return kind if kind in KINDS else None


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
