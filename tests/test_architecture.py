"""The packages' layers hold: ``lint-imports`` keeps pyproject.toml's contract (hsd > benchmarks > ops >
dispatcher | target_worker | drafter_worker > common: nothing imports upward, the daemon and the workers
never import each other), and no package reaches into another's private names (``from X.y import _z``):
what one package uses of another is a public name of that module, kept as such."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the contract's root_packages line (read by hand: tomllib is Python 3.11+, the project runs on 3.10)
PACKAGES = json.loads(re.search(r"^root_packages = (\[.*\])$", (REPO / "pyproject.toml").read_text(), re.M).group(1))


def test_lint_imports_keeps_the_layers_contract():
    # The venv's own script, beside this interpreter; no cache, so it reads the tree as it is now.
    lint_imports = Path(sys.executable).with_name("lint-imports")
    assert lint_imports.is_file(), f"{lint_imports} is missing: install the test extra (make install)"
    proc = subprocess.run([str(lint_imports), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"Contracts: \d+ kept, 0 broken", proc.stdout), proc.stdout[-4000:]


def _source_files() -> list[Path]:
    """Every .py file of the project but the tests': the packages', and any script beside them."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    files = [REPO / line for line in tracked.stdout.split() if not line.startswith("tests/")]
    return [f for f in files if f.is_file()]  # a file deleted in the work tree but not yet in git


def private_imports_across_packages(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: from X import _name`` (or ``import X._name``) where X is a project package other than
    the one the file is in."""
    home = path.relative_to(root).parts[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        else:
            continue
        for module, names in modules:
            parts = module.split(".")
            if parts[0] not in PACKAGES or parts[0] == home:
                continue
            private = [p for p in parts[1:] + names if p.startswith("_") and not p.startswith("__")]
            if private:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {module} {', '.join(private)}")
    return found


def test_no_package_imports_another_packages_private_names():
    files = _source_files()
    assert len(files) > 100 and any(f.parts[-2] == "hsd" for f in files)
    found = [line for path in files for line in private_imports_across_packages(path)]
    assert found == [], "private names used across packages (make them public, or move them):\n" + "\n".join(found)


def test_the_private_name_scan_sees_what_it_looks_for(tmp_path):
    bench = tmp_path / "benchmarks" / "x.py"
    bench.parent.mkdir()
    bench.write_text("from ops.launch import _die\nimport dispatcher._core\nfrom benchmarks.y import _own\n"
                     "from ops.launch import Launcher\n\n\ndef f():\n    from target_worker.prepare import _Writer\n")
    assert private_imports_across_packages(bench, root=tmp_path) == [
        "benchmarks/x.py:1: ops.launch _die", "benchmarks/x.py:2: dispatcher._core _core",
        "benchmarks/x.py:8: target_worker.prepare _Writer"]
