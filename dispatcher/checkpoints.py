"""What the dispatcher knows of each model's durable checkpoints: the step of the latest one.

A run is done only once every model's last commit is covered by a checkpoint of it, so this is
what a finished run waits for. A checkpoint becomes known three ways: the drafter's ``checkpoint``
report once its files are on disk, the checkpoint a drafter says it holds when it registers (one
written while no dispatcher listened), and — for a model no live drafter trains once every job is
committed — the model's newest whole checkpoint found in the run directory (its files checked
against its manifest: a damaged one is passed over, in one line naming the file, for the older one a
drafter resuming would load too). Each is journaled, and a rollback below a known checkpoint lowers
it (live and on replay alike).
"""

from __future__ import annotations

import logging
from pathlib import Path

from common.run.checkpoint_manifest import DamagedCheckpoint
from common.run.records.events import Checkpointed
from common.run.witness import NoUsableCheckpoint, list_models, model_dir, newest_usable
from dispatcher.journal import Journal

log = logging.getLogger("hsd.dispatcher")


class KnownCheckpoints(dict):
    """model -> the step of its latest durable checkpoint the dispatcher knows of."""

    def __init__(self, run_dir: str | Path, journal: Journal):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.journal = journal
        self._known_good: dict[Path, tuple] = {}  # step directories found whole (newest_usable)
        self._said: set[str] = set()  # the damage already logged

    def lower_to(self, model: str, step: int) -> None:
        """The model was rolled back to ``step``: a checkpoint past it is no longer its history."""
        if step < self.get(model, 0):
            self[model] = step

    def holds_model(self, model: str) -> bool:
        """This run directory holds the model's checkpoints (a group spread over nodes without
        shared storage keeps them where its rank 0 runs)."""
        return model_dir(self.run_dir, model).exists()

    def refuse_unusable(self) -> None:
        """Before the run starts: every model with checkpoints in this run directory has a whole one
        (a damaged newest one is said, in one line naming the file, and passed over for the older
        one its drafter will load). One with none whole is refused (:class:`NoUsableCheckpoint`,
        naming each file and what to do): its drafter could not resume it, and the only copy of its
        acknowledged commits is damaged."""
        for model in list_models(self.run_dir):
            newest_usable(self.run_dir, model, known_good=self._known_good, said=self._said)

    def on_disk(self, model: str) -> int | None:
        """The step of the model's newest whole checkpoint in this run directory, the one a drafter
        resuming it would load (None: none here; 0: every one here is damaged)."""
        try:
            found = newest_usable(self.run_dir, model, known_good=self._known_good, said=self._said)
        except NoUsableCheckpoint as exc:
            if str(exc) not in self._said:
                self._said.add(str(exc))
                log.error("%s", exc)
            return 0
        except (OSError, DamagedCheckpoint, ValueError):  # gone while read: not a checkpoint to count on
            return None
        return found.checkpoint.step if found is not None else None

    def adopt(self, model: str, step: int, *, ledger_step: int, worker_id: str | None, via: str) -> None:
        """A durable checkpoint the dispatcher did not hear of when it was written: counted when it
        is of the ledger's history (never past its step) and, where this run directory holds the
        model's checkpoints, present there."""
        if step <= self.get(model, 0):
            return
        if step > ledger_step:
            log.warning("model %s: a checkpoint of step %d (%s) is past the ledger's step %d: not counted",
                        model, step, via, ledger_step)
            return
        if model_dir(self.run_dir, model).exists() and (self.on_disk(model) or 0) < step:
            log.warning("model %s: no checkpoint of step %d in %s (%s): not counted", model, step, self.run_dir, via)
            return
        self[model] = step
        self.journal.record(Checkpointed(model=model, step=step, w=worker_id, via=via), durable=True)
        log.info("model %s: checkpoint at step %d known (%s)", model, step, via)
