"""The simulated clients of ``hsd bench dispatcher`` (:mod:`benchmarks.dispatcher_load`): targets,
drafters, and the models they train, with the witness that judges exactly-once: each model keeps the
ids it trained on (a full list for small runs, an order-free digest of the multiset otherwise), and
reloads it with its checkpoint."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from common.mix import MASK64, splitmix64


def mix64(x: int) -> int:
    """The digest of a job id (a multiset is digested as the sum of its members')."""
    return splitmix64(x)


def mix64_array(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class SimModel:
    """A drafter's model as far as the witness goes: its step and the jobs it trained on."""

    def __init__(self, model_id: str, *, full: bool):
        self.id = model_id
        self.step, self.count, self.digest = 0, 0, 0
        self.trained = array("q") if full else None
        self.saved = (0, 0, 0, 0)  # the checkpoint: step, count, digest, length of trained

    def train(self, job_ids: list[int]) -> None:
        self.step += 1
        self.count += len(job_ids)
        self.digest = (self.digest + sum(mix64(j) for j in job_ids)) & MASK64
        if self.trained is not None:
            self.trained.extend(job_ids)

    def checkpoint(self) -> None:
        self.saved = (self.step, self.count, self.digest, len(self.trained) if self.trained is not None else 0)

    def crash(self) -> None:
        self.step, self.count, self.digest, length = self.saved
        if self.trained is not None:
            del self.trained[length:]


@dataclass
class SimDrafter:
    id: str
    model: SimModel
    window: list[int]
    training: int | None = None  # a job handed out but not yet reported consumed (only while hung)
    hung_until: float = 0.0
    finished: bool = False


@dataclass
class SimTarget:
    id: str
    extracting: list[tuple[int, int]]  # (job id, generation)
    hung_until: float = 0.0
    finished: bool = False
