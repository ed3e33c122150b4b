"""What a drafter's config section becomes for its trainer, the same for DFlash and EAGLE-3: the
section's keys with ``total_steps`` resolved to a positive count (the section's 0 means "derive it
from the run", which :mod:`drafter_worker.drafter_backend` does), the recipe checked before a model
is built, and the draft model's config made from the section's model keys and the target."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from common.run.config import model_keys
from drafter_worker.recipe import validate_recipe


class TrainSection:
    """Mixed in before the section's dataclass: ``class DFlashTrainConfig(TrainSection, DFlashSection)``."""

    SECTION: ClassVar[str]  # the config section's name
    MODEL_KEYS: ClassVar[type]  # the section's keys that shape the model
    MODEL_CONFIG: ClassVar[Any]  # the draft model's config class, with from_target(target_dir, layer_ids=, **keys)

    @classmethod
    def from_section(cls, section: Any, *, total_steps: int) -> Any:
        """The run's section with its total steps resolved."""
        return cls(**{**dataclasses.asdict(section), "total_steps": total_steps})

    def validate(self) -> None:
        validate_recipe(self.SECTION, self)

    def model_config(self, target_dir: str | Path, layer_ids: list[int]) -> Any:
        """The draft model of this section's model keys on the target at ``target_dir``."""
        return self.MODEL_CONFIG.from_target(target_dir, layer_ids=layer_ids, **model_keys(self.MODEL_KEYS, self))
