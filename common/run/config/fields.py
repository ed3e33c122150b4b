"""What every config section is made of: a key (:func:`opt`: its default and help line), the one
coercer that reads a value as its key's type hint (:func:`coerce`), and :class:`Section`, the base of
the sections, which coerces its values and checks its own rules when it is built.

The type hints are the schema: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` (a choice, whose
allowed values are the ``Literal``'s: a component that needs them takes them with ``typing.get_args``),
``list[X]`` and ``X | None``, nested as a section needs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import field
from typing import Any, Callable, ClassVar, Literal


class ConfigError(ValueError):
    """A configuration value a user can get wrong: the message names the key."""


def opt(default: Any, help: str) -> Any:
    """A config field with a default and a one-line description (shown by ``hsd config``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _int(key: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _float(key: str, value: Any) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 4e-5 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ConfigError(f"{key}: expected a finite number, got {value!r}")


def _str(key: str, value: Any) -> str:
    if value is None:  # an empty YAML value
        return ""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")


_SCALARS: dict[Any, Callable[[str, Any], Any]] = {bool: _bool, int: _int, float: _float, str: _str}


def coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` read as the type ``hint``, or a :class:`ConfigError` that names ``key`` and says what was
    expected and what was given. Values come typed (from YAML, an override's YAML text, or code); an int
    is a float's too, a number or an empty value a string's (as its text, or ``""``)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if any(value == choice and type(value) is type(choice) for choice in allowed):  # True is not 1
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [option for option in options if option is not type(None)]
        return coerce(key, value, inner)
    if hint in _SCALARS:
        return _SCALARS[hint](key, value)
    raise AssertionError(f"unsupported config type {hint!r} for {key}")


def is_text(hint: Any) -> bool:
    """A key whose override is taken as typed, not read as YAML: a string (a secret ``0123`` stays
    ``0123``) or a choice among strings."""
    if typing.get_origin(hint) is Literal:
        return all(isinstance(choice, str) for choice in typing.get_args(hint))
    return hint is str


def type_name(hint: Any) -> str:
    """A key's type as ``hsd config`` shows it: ``int``, ``list``, ``str`` for a choice among strings."""
    if typing.get_origin(hint) is Literal:
        return type(typing.get_args(hint)[0]).__name__
    return getattr(hint, "__name__", str(hint))


@functools.cache
def key_types(section_type: type) -> dict[str, Any]:
    """A section's keys, in their declared order, and their type hints."""
    hints = typing.get_type_hints(section_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_type)}


class Section:
    """Base of the config sections: a dataclass whose fields are the section's keys. Built (from a
    config file and overrides, or in code) it reads every value as its key's type (:func:`coerce`) and
    checks its own rules (:meth:`check`): a section that exists holds valid values, whoever built it.
    The rules that span sections are :func:`common.run.config.loading.validate`'s."""

    section: ClassVar[str]  # the section's name in a config file: pool in pool.slots

    def __post_init__(self) -> None:
        for name, hint in key_types(type(self)).items():
            setattr(self, name, coerce(self.key(name), getattr(self, name), hint))
        self.check()

    def check(self) -> None:
        """The section's own rules over its coerced values; each error names its key."""

    def key(self, name: str) -> str:
        return f"{self.section}.{name}"

    def require_positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.key(name)} must be positive")

    def require_not_negative(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.key(name)} must not be negative")
