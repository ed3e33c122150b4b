"""``make gpu-wheels`` carries all that an image with only torch and transformers lacks.

The wheels are the Makefile's list, downloaded for this interpreter (the GPU image's is 3.12; the
list is the same). The image is a fresh venv that sees only torch, transformers and what they
require (linked from this environment into a directory on its path), and the wheels are unzipped
onto ``PYTHONPATH`` as the device command does where pip is absent. There every module of the
project imports and ``hsd bench gpu`` runs its preflight, which finds nothing missing. Skipped
only when the package index cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
IMAGE = ("torch", "transformers")  # what a stock PyTorch image with transformers has, with their requirements
UNREACHABLE = re.compile(r"NewConnectionError|Network is unreachable|Temporary failure in name resolution|"
                         r"Max retries exceeded|ProxyError|Connection refused|timed out", re.I)
# Modules a GPU host need not import: extras of other commands (a plot, reads across nodes).
OPTIONAL = {"matplotlib", "nixl"}

IMPORT_ALL = """
import importlib, json, pkgutil, sys
failed, count = {}, 0
for top in ("common", "dispatcher", "target_worker", "drafter_worker", "ops", "benchmarks", "hsd"):
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, prefix=top + "."):
        count += 1
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            failed[info.name] = [exc.name, str(exc)]
print(json.dumps({"count": count, "failed": failed}))
"""


def _requirement_closure(names: tuple[str, ...]) -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement of another platform or Python
        found[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _image_site(root: Path) -> list[str]:
    """A directory holding links to the files of torch, transformers and their requirements only."""
    root.mkdir()
    for dist in _requirement_closure(IMAGE).values():
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (root / top).exists():
                (root / top).symlink_to(source)
    return sorted(p.name for p in root.iterdir())


@pytest.mark.timeout(240)
def test_the_carried_wheels_and_an_image_with_only_torch_and_transformers_run_the_check(tmp_path):
    wheels = tmp_path / "whl"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    made = subprocess.run(["make", "-s", "-C", str(REPO), "gpu-wheels", f"PYTHON={sys.executable}",
                           f"GPU_PYTHON_VERSION={version}", f"GPU_WHEEL_DIR={wheels}"],
                          capture_output=True, text=True, timeout=150)
    if made.returncode != 0 and UNREACHABLE.search(made.stderr):
        pytest.skip(f"the package index is unreachable: {made.stderr.strip().splitlines()[-1]}")
    assert made.returncode == 0, made.stderr
    carried = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(carried) == 7, carried  # accelerate among them: transformers' tensor-parallel loading

    image = _image_site(tmp_path / "image")
    assert "torch" in image and "transformers" in image and "zmq" not in image and "msgspec" not in image
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=60)
    python = tmp_path / "venv" / "bin" / "python"
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "image.pth").write_text(f"{tmp_path / 'image'}\n")
    unzipped = tmp_path / "site"  # the device command's path where pip is absent
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(unzipped)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=f"{unzipped}{os.pathsep}{REPO}", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")

    without = subprocess.run([str(python), "-c", "import zmq"], env={**env, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=60)
    assert without.returncode != 0, "the image already has pyzmq: it does not stand for a stock one"
    imported = subprocess.run([str(python), "-c", IMPORT_ALL], env=env, capture_output=True, text=True, timeout=180,
                              cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr[-3000:]
    result = json.loads(imported.stdout.strip().splitlines()[-1])
    unexpected = {module: why for module, (name, why) in result["failed"].items()
                  if (name or "").split(".")[0] not in OPTIONAL}
    assert result["count"] > 100 and not unexpected, unexpected

    out = tmp_path / "out"
    check = subprocess.run([str(python), "-m", "hsd.cli", "bench", "gpu", "--out", str(out)], env=env,
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]
    facts = json.loads((out / "00-preflight.json").read_text())
    assert facts["missing"] == [] and facts["python"]["executable"] == str(python)
    assert all(facts["modules"][name]["path"].startswith(str(unzipped))
               for name in ("zmq", "msgspec", "msgpack", "psutil", "prometheus_client"))
