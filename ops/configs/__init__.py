"""The run configs shipped with the package: the demos' (``hsd demo``, ``make demo-sim``) and the
8-GPU example. ``deploy/configs`` links to these files; the CLI finds them with
:mod:`importlib.resources`, so an installed wheel reads its own copies, not a checkout's."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_config(name: str) -> Path:
    """The path of the shipped config ``name`` (e.g. ``demo-real.yaml``)."""
    resource = resources.files(__name__) / name
    if not resource.is_file():
        raise FileNotFoundError(f"config {name} is not shipped with hsdispatch (looked in {resource})")
    # Installed as files (a wheel unpacks), so the resource is a path already: it outlives this call.
    return Path(str(resource))
