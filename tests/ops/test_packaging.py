"""What the wheel holds: every package of the source tree (found, not listed) and the configs the
CLI runs, read through importlib.resources. ``.ci/wheel_smoke.sh`` builds and installs the wheel and
runs it from outside the checkout; this is the cheap half of it, on every test run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import setuptools

from common.run.drafter_family import families
from ops.configs import bundled_config

REPO = Path(__file__).resolve().parents[2]


def test_every_package_with_an_init_is_in_the_wheel_and_no_test_is() -> None:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(setuptools.find_packages(str(REPO), include=find["include"], exclude=find["exclude"]))
    in_tree = {str(p.parent.relative_to(REPO)).replace("/", ".") for p in REPO.glob("*/**/__init__.py")
               if p.parts[len(REPO.parts)] not in ("tests", ".venv", "build")}
    assert found == in_tree and "drafter_worker.eagle3" in found and not any(p.startswith("tests") for p in found)


def test_the_demo_configs_are_package_data() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data == {"ops.configs": ["*.yaml"]}
    shipped = sorted(p.name for p in (REPO / "ops" / "configs").glob("*.yaml"))
    links = sorted((REPO / "deploy" / "configs").glob("*.yaml"))
    assert shipped == [p.name for p in links] and shipped
    assert all(p.resolve() == (REPO / "ops" / "configs" / p.name).resolve() for p in links)
    for path in (bundled_config(family.demo.config_name) for family in families() if family.demo is not None):
        assert path.is_file() and path.parent.name == "configs" and path.parent.parent.name == "ops"
    assert bundled_config("demo-sim.yaml").read_text() == (REPO / "deploy" / "configs" / "demo-sim.yaml").read_text()
