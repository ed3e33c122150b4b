"""Drafter families: everything the rest of the system knows about a drafter objective
(``drafter.objective``), in one table its families fill.

A family (DFlash, EAGLE-3, ...) registers a :class:`DrafterFamily` from its own package
(``drafter_worker/<family>/family.py``): its config section, the capture layers it trains on by
default, its backend, its export loader and proposer, and its demo and GPU-check defaults. Code
outside the family looks a family up here (:func:`family_of`) and never branches on its name.

The table is filled on first use: the built-in families' modules, then every module named in the
``HSD_DRAFTER_FAMILIES`` environment variable (comma-separated), are imported, and each calls
:func:`register`. The variable is inherited by the processes ``hsd launch`` starts, so a family
defined outside this package (a test's, a plugin's) reaches the dispatcher, the targets and the
drafters alike. A family module must import no torch at module level: the dispatcher and the sim
workers load it too; its heavy parts are loaders, called when used.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ENV = "HSD_DRAFTER_FAMILIES"
# Modules named, not imported: the families live above common, which only holds their table.
BUILTIN_FAMILIES = ("drafter_worker.dflash.family", "drafter_worker.eagle3.family")
DEFAULT_OBJECTIVE = "dflash"  # drafter.objective when a config names none


@dataclass(frozen=True)
class DemoDefaults:
    """What ``hsd demo --objective <name>`` starts from and says about the trained drafter."""
    config_name: str  # the bundled config file (deploy/configs) the demo starts from
    run_name: str  # its run directory under --out (the demos share the target and data)
    shape: Callable[[int], str]  # the drafts of one round, from the evaluation's block size ("block 16")


@dataclass(frozen=True)
class DrafterFamily:
    objective: str  # the drafter.objective naming it
    title: str  # its name in messages and summaries ("EAGLE-3")
    section: type  # its config section (a common.run.config Section; ``section.section`` is its name)
    default_layer_ids: Callable[[int, int], list[int]]  # (target layers N, target.num_capture_layers) -> ids
    backend: Callable[..., Any]  # (model_id, *, training, target, drafter, run, data, device, schedule_jobs)
    load_proposer: Callable[..., Any]  # (drafter_dir, target_dir, *, device) -> a Proposer of an export
    proposer: Callable[[Any], Any]  # a draft model of this family -> its Proposer (hsd eval of a live model)
    reads_export: Callable[[dict], bool] = lambda doc: False  # an exported config.json is this family's
    final_norm: bool = False  # the contract carries the target's final-norm state after the layers
    num_fused_layers: int = 0  # > 0: the drafter takes exactly this many captured layers
    needs_target_model: bool = True  # the backend reads the target's config.json and weights
    demo: DemoDefaults | None = None
    check_overrides: tuple[str, ...] = ()  # hsd bench gpu: a small backend of this family on the tiny target

    @property
    def section_name(self) -> str:
        return self.section.section


def lazy(path: str) -> Callable[..., Any]:
    """``module:name``, imported at the first call and called with its arguments: a family's heavy
    parts (torch, its model) load only where they are used."""
    module, name = path.split(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)
    return call


_FAMILIES: dict[str, DrafterFamily] = {}
_loaded = False


def register(family: DrafterFamily) -> DrafterFamily:
    """Add ``family`` to the table (called by a family module when it is imported)."""
    known = _FAMILIES.get(family.objective)
    if known is not None and known is not family:
        raise ValueError(f"drafter objective {family.objective!r} is registered twice")
    clash = [f.objective for f in _FAMILIES.values() if f.section_name == family.section_name and f is not family]
    if clash:
        raise ValueError(f"config section {family.section_name!r} of {family.objective!r} is {clash[0]!r}'s")
    _FAMILIES[family.objective] = family
    return family


def extra_family_modules(environ: Any = os.environ) -> list[str]:
    return [name.strip() for name in environ.get(ENV, "").split(",") if name.strip()]


def load_families(modules: Sequence[str] = ()) -> None:
    """Import the built-in family modules, those of ``HSD_DRAFTER_FAMILIES`` and ``modules``."""
    global _loaded
    if not _loaded:
        _loaded = True
        for name in (*BUILTIN_FAMILIES, *extra_family_modules()):
            importlib.import_module(name)
    for name in modules:
        importlib.import_module(name)


def families() -> list[DrafterFamily]:
    """Every registered family, built-in ones first."""
    load_families()
    return list(_FAMILIES.values())


def family_of(objective: str) -> DrafterFamily:
    """The family of ``objective``; a ConfigError naming the known ones if none is registered."""
    load_families()
    if objective not in _FAMILIES:
        from common.run.config.fields import ConfigError
        raise ConfigError(f"drafter.objective: no drafter family {objective!r} (known: {', '.join(_FAMILIES)}; "
                          f"a family outside this package is loaded by naming its module in {ENV})")
    return _FAMILIES[objective]


def export_family(doc: dict) -> DrafterFamily:
    """The family whose export ``doc`` (a drafter's config.json) is; one no family claims is read as the
    default objective's, whose loader says what it lacks."""
    for family in families():
        if family.reads_export(doc):
            return family
    return family_of(DEFAULT_OBJECTIVE)
