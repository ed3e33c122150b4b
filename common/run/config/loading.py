"""Reading a run's configuration: a YAML file, then ``section.key=value`` overrides, into the sections
of :class:`common.run.config.sections.Config`; the rules that span sections or look at the disk
(:func:`validate`); the resolved file a run directory keeps; the ``hsd config`` listing.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

from common.run.config.fields import ConfigError, is_text, key_types, type_name
from common.run.config.sections import Config, section_types
from common.run.drafter_family import family_of
from common.run.durable import atomic_write
from common.run.serving_layers import unservable_reason
from common.run.target_config import read_model_config

RESOLVED_CONFIG_NAME = "config.yaml"
_PATH_KEYS = (("run", "dir"), ("data", "lengths"), ("data", "path"), ("target", "model"))


def _section_type(section: str) -> type:
    types = section_types()
    if section not in types:
        raise ConfigError(f"unknown config section {section!r} (known: {', '.join(types)})")
    return types[section]


def _key_type(section: str, key: str) -> Any:
    keys = key_types(_section_type(section))
    if key not in keys:
        raise ConfigError(f"unknown config key {section}.{key} (known: {', '.join(keys)})")
    return keys[key]


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is read as YAML (``[1, 2]``, ``true``),
    except for string keys, which keep the text as given (a secret ``0123`` stays ``0123``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    dotted, raw = text.split("=", 1)
    if dotted.count(".") != 1:
        raise ConfigError(f"override {text!r}: the key must be section.key")
    section, key = dotted.split(".")
    if is_text(_key_type(section, key)):
        return section, key, raw
    import yaml  # imported where it reads: hsd bench gpu's preflight runs without PyYAML

    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {dotted}: cannot parse value {raw!r}: {exc}") from None
    return section, key, value


def _read_file(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """A config file's values by section and key (keys checked, values as YAML typed them)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections")
    values: dict[str, dict[str, Any]] = {}
    for section, keys in doc.items():
        section = str(section)
        _section_type(section)
        if keys is None:  # an empty section
            continue
        if not isinstance(keys, dict):
            raise ConfigError(f"config section {section!r} must be a mapping of keys")
        for key, value in keys.items():
            _key_type(section, str(key))
            values.setdefault(section, {})[str(key)] = value
    return values


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config file (optional), apply overrides, make paths absolute, validate."""
    values = _read_file(path) if path is not None else {}
    for text in overrides:
        section, key, value = parse_override(text)
        values.setdefault(section, {})[key] = value
    # Each section coerces and checks its own values as it is built.
    sections = {name: section_type(**values.get(name, {})) for name, section_type in section_types().items()}
    core = typing.get_type_hints(Config)
    config = Config(**{name: sections.pop(name) for name in core}).with_family_sections(sections)
    for section, key in _PATH_KEYS:
        value = getattr(getattr(config, section), key)
        if value:
            setattr(getattr(config, section), key, str(Path(value).expanduser().resolve()))
    validate(config)
    return config


def validate(config: Config) -> None:
    """What no one section can check alone: rules across sections, and the files the paths name."""
    if config.schedule.assignment == "per_target" and config.target.count < 1:
        raise ConfigError("schedule.assignment=per_target needs target.count >= 1 (one queue per target)")
    for section, key in _PATH_KEYS[1:]:
        value = getattr(getattr(config, section), key)
        if value and not Path(value).exists():
            hint = " (a local model directory: nothing is downloaded)" if (section, key) == ("target", "model") else ""
            raise ConfigError(f"{section}.{key}: {value} does not exist{hint}")
    _validate_capture(config)


def _validate_capture(config: Config) -> None:
    """The captured layers against the target model's config and the drafter objective."""
    if not config.target.model:
        return
    try:
        doc = read_model_config(config.target.model)
    except ValueError as exc:
        raise ConfigError(f"target.model: {exc}") from None
    layers = config.target.capture_layers
    family = family_of(config.drafter.objective)
    # Imported here: the contract is a msgspec struct, and reading a config (``hsd bench gpu``'s
    # preflight among others) must work in an image that lacks msgspec.
    from common.run.capture_contract import contract_from_config
    try:
        contract = contract_from_config(config, model_config=doc)
    except ValueError as exc:
        key = "capture_layers" if layers or family.num_fused_layers else "num_capture_layers"
        raise ConfigError(f"target.{key}: {exc}") from None
    if family.num_fused_layers and contract.num_capture_layers != family.num_fused_layers:
        # A drafter whose serving engines build its fc for a fixed count (EAGLE-3: 3 x hidden -> hidden).
        raise ConfigError(f"target.capture_layers: an {family.title} drafter fuses exactly "
                          f"{family.num_fused_layers} target layers, got {list(contract.layer_ids)}")
    reason = unservable_reason(contract.layer_ids, num_layers=contract.num_layers, objective=config.drafter.objective)
    if reason and not config.target.allow_unservable:
        raise ConfigError(f"target.capture_layers {list(contract.layer_ids)}: {reason}")


RESOLVED_HEADER = ("# The run's resolved config. nodes.name is left empty: each node names its own (hsd target/drafter\n"
                   "# --node, nodes.name=..., or by default its hostname), never the node that wrote this file.\n")


def write_resolved(config: Config, run_dir: Path | None = None) -> Path:
    run_dir = Path(run_dir or config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_CONFIG_NAME
    doc = config.to_dict()
    import yaml

    doc["nodes"]["name"] = ""  # node-local: a worker started from this file on another node is not this one
    return atomic_write(target, RESOLVED_HEADER + yaml.safe_dump(doc, sort_keys=False),
                        tmp_name=target.with_suffix(".tmp").name)


def load_run_config(run_dir: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Config:
    """The resolved config of an existing run directory."""
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no {RESOLVED_CONFIG_NAME})")
    return load_config(path, overrides)


def describe() -> str:
    """Every section and key with its type, default and help line."""
    lines = []
    for name, section_type in section_types().items():
        lines.append(f"{name}:")
        hints = key_types(section_type)
        for f in dataclasses.fields(section_type):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name}: {default!r}  # ({type_name(hints[f.name])}) {f.metadata.get('help', '')}")
    return "\n".join(lines)
