"""Run configuration: one YAML file, one typed dataclass per section.

Every subcommand takes ``--config FILE`` plus ``section.key=value`` overrides. Unknown sections or
keys and ill-typed values raise :class:`ConfigError` naming the key. The resolved configuration is
written into the run directory so that every process of a run (and a later resume) sees the same
values.

:mod:`common.run.config.fields` holds the machinery (a key, the coercer driven by the type hints, the
:class:`Section` base), :mod:`common.run.config.sections` the sections and the choices' ``Literal`` types
(a drafter family's own section is its package's: :mod:`common.run.drafter_family`),
:mod:`common.run.config.loading` the file, the overrides, the resolved file and the ``hsd config`` listing.
"""

from common.run.config.fields import ConfigError, Section, coerce, opt
from common.run.config.loading import (RESOLVED_CONFIG_NAME, describe, load_config, load_run_config, parse_override,
                                   validate, write_resolved)
from common.run.config.sections import (Batching, Config, CurveSection, DataSection, DispatcherSection, DrafterSection,
                                        ElasticBatch, Locality, NodesSection, Objective, Order, PoolSection, Pull,
                                        RunSection, ScheduleSection, StepBalance, TargetSection, TrainingRecipe,
                                        Transport, model_keys, section_types, step_jobs)

__all__ = [
    "RESOLVED_CONFIG_NAME", "Batching", "Config", "ConfigError", "CurveSection", "DataSection", "DispatcherSection",
    "DrafterSection", "ElasticBatch", "Locality", "NodesSection", "Objective", "Order", "PoolSection", "Pull",
    "RunSection", "ScheduleSection", "Section", "StepBalance", "TargetSection", "TrainingRecipe", "Transport", "coerce",
    "describe", "load_config", "load_run_config", "model_keys", "opt", "parse_override", "section_types", "step_jobs",
    "validate", "write_resolved",
]
