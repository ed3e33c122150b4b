"""``hsd prepare``: tokenize a conversation dataset into a prepared dataset directory.

Streams: rows are read, tokenized in chunks of ``CHUNK_ROWS`` and appended to the output files, so
memory stays constant however large the input is. Rows that cannot be used are logged with their
file and line (or Parquet row), counted by reason in the manifest, and skipped; the command fails
only when no row is usable. The layout of the output is described in :mod:`common.run.prepared`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np

from common.run.config import ScheduleSection
from common.run.durable import atomic_write, publish
from common.run.prepared import (FORMAT, LENGTHS_FILE, LOSS_MASK_FILE, MANIFEST_FILE, OFFSET_DTYPE, OFFSETS_FILE,
                             TOKEN_DTYPE, TOKENS_FILE, BlockChecksums, checksums_section, load_tokenizer,
                             tokenizer_fingerprint)
from target_worker.chat_rows import NO_ASSISTANT_TURN, TOO_LONG, RowError, parse_json_line, row_format, row_messages
from target_worker.loss_mask import tokenize_samples, turn_end_marker

log = logging.getLogger("hsd.prepare")

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_ROWS = 256  # rows per batched tokenizer call: large enough to amortize, small enough to stream
MAX_LOGGED_BAD_ROWS = 1000  # past this, bad rows are only counted (a broken file must not flood the log)
MAX_BAD_ROW_EXAMPLES = 100  # bad rows listed in the manifest with their line and reason
HISTOGRAM_EDGES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# The default schedule's last bucket: a sample longer than it has no bucket and no epoch trains it.
DEFAULT_MAX_LENGTH = ScheduleSection().buckets[-1]


def input_files(path: str | os.PathLike) -> list[Path]:
    """The file itself, or a folder's JSONL/Parquet shards in name order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"input {path} does not exist")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES)
    if not files:
        raise ValueError(f"input folder {path} holds no .jsonl, .json or .parquet files")
    return files


def read_rows(files: list[Path]) -> Iterator[tuple[str, dict | RowError]]:
    """``(where, row)`` for every row of every file, or ``(where, RowError)`` for an unreadable one."""
    for path in files:
        if path.suffix in PARQUET_SUFFIXES:
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
            number = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=CHUNK_ROWS):
                for row in batch.to_pylist():
                    number += 1
                    yield f"{path.name}:row {number}", row
            continue
        with open(path, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path.name}:{number}", parse_json_line(line)
                except RowError as exc:
                    yield f"{path.name}:{number}", exc


def length_histogram(lengths: Counter) -> list[dict]:
    """Sample counts per length range, the ranges following the default schedule buckets."""
    rows, lower, longest = [], 0, max(lengths)
    for edge in HISTOGRAM_EDGES + (None,):
        if lower >= longest:
            break
        count = sum(n for length, n in lengths.items() if length > lower and (edge is None or length <= edge))
        rows.append({"min": lower + 1, "max": edge, "count": count})
        lower = edge or longest
    return rows


class DatasetWriter:
    """Appends samples to the output files (under temporary names until :meth:`finish`). Also for
    whoever writes a prepared dataset of made-up token ids (tests, ``hsd bench gpu``'s launch inputs)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.names = (TOKENS_FILE, LOSS_MASK_FILE, OFFSETS_FILE, LENGTHS_FILE)
        self.files = {name: open(out_dir / f"{name}.partial", "wb") for name in self.names}
        self.checksums = {name: BlockChecksums() for name in self.names}  # of what was written, as it is
        self.num_tokens = 0
        self.num_loss_tokens = 0
        self.num_samples = 0
        self.lengths: Counter = Counter()  # length -> count: bounded by the longest length, not the rows
        self._write(OFFSETS_FILE, np.asarray([0], dtype=OFFSET_DTYPE).tobytes())

    def _write(self, name: str, data: bytes) -> None:
        self.files[name].write(data)
        self.checksums[name].update(data)

    def add(self, ids: list[int], mask: list[int]) -> None:
        self._write(TOKENS_FILE, np.asarray(ids, dtype=TOKEN_DTYPE).tobytes())
        self._write(LOSS_MASK_FILE, bytes(mask))
        self.num_tokens += len(ids)
        self.num_loss_tokens += sum(mask)
        self.num_samples += 1
        self.lengths[len(ids)] += 1
        self._write(OFFSETS_FILE, np.asarray([self.num_tokens], dtype=OFFSET_DTYPE).tobytes())
        self._write(LENGTHS_FILE, f"{len(ids)}\n".encode())

    def checksums_section(self) -> dict:
        """The manifest's ``checksums``: each file's size and block checksums, for :func:`validate_prepared`."""
        return checksums_section({name: self.checksums[name].record() for name in self.names})

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()

    def finish(self) -> None:
        for handle in self.files.values():
            handle.flush()
            os.fsync(handle.fileno())
        self.close()
        for name in self.names:
            publish(self.out_dir / f"{name}.partial", self.out_dir / name)

    def discard(self) -> None:
        self.close()
        for name in self.names:
            (self.out_dir / f"{name}.partial").unlink(missing_ok=True)


def prepare_dataset(input_path: str | os.PathLike, tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike,
                    *, max_length: int = DEFAULT_MAX_LENGTH, per_turn: bool = False, progress: bool = True) -> dict:
    """Tokenize ``input_path`` into ``out_dir``; returns the manifest. Raises ValueError when no row
    is usable (after logging why each row was skipped). ``per_turn``: one sample per assistant turn
    instead of one per conversation (see :mod:`target_worker.loss_mask`)."""
    from tqdm import tqdm

    if max_length <= 0:
        raise ValueError(f"--max-length must be positive, got {max_length}")
    files = input_files(input_path)
    tokenizer = load_tokenizer(tokenizer_dir)
    turn_end = turn_end_marker(tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # the old manifest must not vouch for new files
    writer = DatasetWriter(out_dir)
    bad: Counter = Counter()
    examples: list[dict] = []
    formats: Counter = Counter()
    num_rows = num_used = 0

    def skip(where: str, error: RowError) -> None:
        bad[error.reason] += 1
        if len(examples) < MAX_BAD_ROW_EXAMPLES:
            examples.append({"where": where, "reason": error.reason, "message": str(error)})
        total = sum(bad.values())
        if total <= MAX_LOGGED_BAD_ROWS:
            log.warning("%s: skipped (%s): %s", where, error.reason, error)
            if total == MAX_LOGGED_BAD_ROWS:
                log.warning("further skipped rows are counted in the manifest but not logged")

    def flush(chunk: list[tuple[str, list[dict]]]) -> None:
        nonlocal num_used
        results = tokenize_samples(tokenizer, [messages for _, messages in chunk], turn_end, per_turn=per_turn)
        for (where, _), result in zip(chunk, results):
            if isinstance(result, RowError):
                skip(where, result)
                continue
            longest = max((len(ids) for ids, _ in result), default=0)
            if not result:
                skip(where, RowError(NO_ASSISTANT_TURN, "every assistant turn renders as whitespace"))
            elif longest > max_length:  # a row is used whole or not at all, in either way of sampling
                skip(where, RowError(TOO_LONG, f"{longest} tokens, longer than --max-length {max_length}"))
            else:
                num_used += 1
                for sample in result:
                    writer.add(*sample)
        chunk.clear()

    chunk: list[tuple[str, list[dict]]] = []
    try:
        for where, row in tqdm(read_rows(files), desc="prepare", unit=" rows", disable=not progress,
                               mininterval=1.0):
            num_rows += 1
            try:
                if isinstance(row, RowError):
                    raise row
                formats[row_format(row)] += 1
                chunk.append((where, row_messages(row)))
            except RowError as exc:
                skip(where, exc)
            if len(chunk) >= CHUNK_ROWS:
                flush(chunk)
        flush(chunk)
    except BaseException:
        writer.discard()
        raise
    if writer.num_samples == 0:
        writer.discard()
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(bad.items())) or "the input holds no rows"
        raise ValueError(f"no usable rows in {input_path} ({num_rows} read; skipped {reasons})")
    writer.finish()
    manifest = {
        "format": FORMAT,
        "num_samples": writer.num_samples,
        "num_tokens": writer.num_tokens,
        "num_loss_tokens": writer.num_loss_tokens,
        "samples": "per_turn" if per_turn else "conversation",
        "max_length": max_length,
        "tokenizer": {"path": str(Path(tokenizer_dir).resolve()), "fingerprint": tokenizer_fingerprint(tokenizer),
                      "vocab_size": len(tokenizer), "turn_end": turn_end},
        "lengths": {"min": min(writer.lengths), "max": max(writer.lengths),
                    "mean": round(writer.num_tokens / writer.num_samples, 2),
                    "histogram": length_histogram(writer.lengths)},
        "rows": {"read": num_rows, "used": num_used, "skipped": sum(bad.values()),
                 "skipped_by_reason": dict(sorted(bad.items())), "formats": dict(sorted(formats.items()))},
        "skipped_examples": examples,
        "source": {"input": str(Path(input_path).resolve()),
                   "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files]},
        "files": {"tokens": TOKENS_FILE, "loss_mask": LOSS_MASK_FILE, "offsets": OFFSETS_FILE,
                  "lengths": LENGTHS_FILE},
        "checksums": writer.checksums_section(),
    }
    atomic_write(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n", tmp_name=f"{MANIFEST_FILE}.partial")
    log.info("prepared %d samples (%d tokens, %d in the loss) into %s; %s", writer.num_samples, writer.num_tokens,
             writer.num_loss_tokens, out_dir, rows_summary(manifest["rows"]))
    return manifest


def rows_summary(rows: dict) -> str:
    """The rows of a manifest in a few words: read, by format, and skipped by reason."""
    formats = ", ".join(f"{name} {n}" for name, n in rows["formats"].items())
    reasons = ", ".join(f"{reason} {n}" for reason, n in rows["skipped_by_reason"].items())
    return (f"{rows['read']} rows read" + (f" ({formats})" if formats else "")
            + f", {rows['used']} used, {rows['skipped']} skipped" + (f" ({reasons})" if reasons else ""))
