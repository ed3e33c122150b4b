"""The run journal: an append-only JSON-lines file in the run directory.

Every event that changes what a restart must know (an epoch started, a step committed, a checkpoint
made durable, commits reverted) is appended and fsynced before the dispatcher acknowledges it.
Progress events (a job ready, a worker joined) are buffered and flushed a few times a second
without fsync: the report reads them, a restart does not need them. A torn last line (power cut mid-write) is ignored on reading.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

JOURNAL_NAME = "journal.jsonl"


class Journal:
    """Append-only writer. With ``sync_in_background`` the fsync of durable events runs on a thread
    of its own, so the dispatcher's loop never waits on the disk (a shared filesystem can take tens
    of milliseconds): the loop holds back each reply that needs durability until ``synced_seq``
    reaches it, and ``notify_fd`` becomes readable whenever a sync completes."""

    def __init__(self, run_dir: str | os.PathLike, *, sync_in_background: bool = False):
        self.path = Path(run_dir) / JOURNAL_NAME
        self._file = open(self.path, "a", encoding="utf-8")
        self.written_seq = 0  # durable events written so far
        self.synced_seq = 0   # ... of which fsynced
        self._syncer: threading.Thread | None = None
        if sync_in_background:
            self.notify_fd, self._notify_w = os.pipe()
            os.set_blocking(self.notify_fd, False)
            self._wake = threading.Event()
            self._stopping = False
            self._syncer = threading.Thread(target=self._sync_loop, name="journal-sync", daemon=True)
            self._syncer.start()

    def record(self, event: str, *, durable: bool = False, **fields: Any) -> None:
        """Append one event. A ``durable`` one is on disk when this returns, or (background sync)
        once ``synced_seq`` reaches the ``written_seq`` it got; the others by the next :meth:`flush`
        (the dispatcher flushes a few times a second)."""
        line = json.dumps({"ev": event, "t": round(time.time(), 6), **fields}, separators=(",", ":"))
        self._file.write(line + "\n")
        if durable:
            self._file.flush()
            self.written_seq += 1
            if self._syncer is None:
                os.fsync(self._file.fileno())
                self.synced_seq = self.written_seq
            else:
                self._wake.set()

    @property
    def unsynced(self) -> bool:
        return self.synced_seq < self.written_seq

    def _sync_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            target = self.written_seq  # everything written up to here is flushed to the OS already
            os.fsync(self._file.fileno())
            self.synced_seq = target
            os.write(self._notify_w, b"s")

    def drain_notifications(self) -> None:
        try:
            while os.read(self.notify_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._syncer is not None:
            self._stopping = True
            self._wake.set()
            self._syncer.join()
            self._syncer = None
            os.close(self.notify_fd)
            os.close(self._notify_w)
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self.synced_seq = self.written_seq
            self._file.close()


def read_journal(run_dir: str | os.PathLike) -> Iterator[dict[str, Any]]:
    path = Path(run_dir) / JOURNAL_NAME
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line
            if isinstance(event, dict) and "ev" in event:
                yield event


@dataclass
class Recovered:
    """What a restarting dispatcher needs from the journal."""
    epochs_started: list[int] = field(default_factory=list)
    committed: set[int] = field(default_factory=set)  # job ids whose commit is covered by a checkpoint
    steps_to_revert: list[int] = field(default_factory=list)
    next_step: int = 0
    num_starts: int = 0  # dispatcher starts so far: ids handed out now must differ from theirs


def recover(run_dir: str | os.PathLike) -> Recovered:
    """Replay the journal: commits after the last durable checkpoint are reverted (their jobs rerun)."""
    out = Recovered()
    commits: dict[int, tuple[list[int], bool]] = {}
    last_checkpoint = -1
    for event in read_journal(run_dir):
        kind = event["ev"]
        if kind == "start":
            out.num_starts += 1
        elif kind == "epoch" and event["epoch"] not in out.epochs_started:
            out.epochs_started.append(event["epoch"])
        elif kind == "commit":
            commits[event["step"]] = (event["jobs"], bool(event.get("checkpointed")))
            out.next_step = max(out.next_step, event["step"] + 1)
            if event.get("checkpointed"):  # the model saved with this step holds every earlier one too
                last_checkpoint = max(last_checkpoint, event["step"])
        elif kind == "checkpoint":
            last_checkpoint = max(last_checkpoint, event["step"])
        elif kind == "revert":
            for step in event["steps"]:
                commits.pop(step, None)
    for step, (jobs, checkpointed) in sorted(commits.items()):
        if step <= last_checkpoint:
            out.committed.update(jobs)
        else:
            out.steps_to_revert.append(step)
    return out
