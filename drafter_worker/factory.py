"""The drafter backends of a run's config: where a drafter process reads its :class:`Config` and hands
each backend the sections it reads (no backend sees the whole config).

``hsd drafter`` builds its backend here (:func:`drafter_backend`), and so do the tools and tests that
build one from a config as a worker would. The backend modules are imported when one is built: a
sim drafter loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.run.config import Config, ConfigError
from common.run.drafter_family import family_of

if TYPE_CHECKING:
    import torch


def sim_drafter(config: Config, model_id: str) -> Any:
    """The sim drafter; behind a real target it checks the slots against the dataset the target reads."""
    from drafter_worker.sim import SimDrafter
    dataset_path = config.data.path if not config.target.sim and config.data.path else None
    return SimDrafter(config.drafter, model_id, dataset_path=dataset_path)


def linear_drafter(config: Config, model_id: str) -> Any:
    from drafter_worker.linear_backend import LinearDrafter
    return LinearDrafter(model_id, drafter=config.drafter, target=config.target, seed=config.run.seed)


def trainer_backend(config: Config, model_id: str, *, backend_class: Any = None,
                    device: str | torch.device | None = None, schedule_jobs: int | None = None) -> Any:
    """The drafter model of ``drafter.objective``'s family (or ``backend_class``: DFlashBackend,
    Eagle3Backend), given the family's config section."""
    if backend_class is None:
        family = family_of(config.drafter.objective)
        build, section = family.backend, family.section_name
    else:
        build, section = backend_class, backend_class.section
    return build(model_id, training=getattr(config, section), target=config.target, drafter=config.drafter,
                 run=config.run, data=config.data, device=device, schedule_jobs=schedule_jobs)


def drafter_backend(config: Config, model_id: str) -> Any:
    """What a real (non-sim) drafter runs: drafter.backend's."""
    if config.drafter.backend == "linear":
        return linear_drafter(config, model_id)
    if family_of(config.drafter.objective).needs_target_model and not config.target.model:
        # said before torch loads: the drafter reads the target's config and head
        raise ConfigError("target.model: the drafter needs the target model directory (or use --sim)")
    return trainer_backend(config, model_id)
