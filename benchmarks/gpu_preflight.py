"""The preflight of ``hsd bench gpu``: what this host has, found before any section runs.

Written first (``00-preflight.json``) so that a first run on an unknown image returns at least the
reason it could not measure: the interpreter and its path, the versions of torch, CUDA,
transformers and triton, every module ``hsd`` imports (found or not, and why not), a C compiler
and ``Python.h`` (Triton builds its launchers with them at run time), the size of ``/dev/shm``,
the GPUs (name, memory, peer access) and whether ``flash_attn`` is installed (``auto`` would then
pick it for the target). Each section names what it needs (:data:`SECTION_NEEDS`); one whose needs
are missing is skipped with that reason (:func:`unmet`) instead of run to a crash.

This module imports only the standard library at its top: it must run where the image lacks
``hsd``'s own dependencies. The CUDA facts come from a child interpreter under a timeout, so a
driver that hangs costs the preflight seconds, not the check.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_CUDA = "no CUDA"
CUDA_PROBE_TIMEOUT_S = 45.0

# What hsd's processes import (the wheel's dependencies), by import name; then what some sections add.
RUNTIME_MODULES = ("torch", "transformers", "numpy", "safetensors", "tokenizers", "tqdm", "yaml", "zmq", "msgspec",
                   "msgpack", "psutil")
LAUNCH_MODULES = (*RUNTIME_MODULES, "prometheus_client")  # a launched dispatcher serves /metrics
OPTIONAL_MODULES = ("triton", "pytest", "flash_attn", "pyarrow")
DISTRIBUTIONS = {"yaml": "PyYAML", "zmq": "pyzmq"}  # import name -> distribution, where they differ

CUDA_PROBE = r"""
import json, sys
import torch
facts = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda": torch.cuda.is_available()}
if facts["cuda"]:
    n = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    facts["gpus"] = [{"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count} for p in props]
    facts["peer_access"] = [[a == b or bool(torch.cuda.can_device_access_peer(a, b)) for b in range(n)]
                            for a in range(n)]
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        facts["nccl"] = f"unavailable: {type(exc).__name__}: {exc}"
print(json.dumps(facts))
"""


@dataclass(frozen=True)
class Needs:
    """What a section needs of the host: modules that import, GPUs, a compiler for Triton, /dev/shm room."""

    modules: tuple[str, ...] = LAUNCH_MODULES
    gpus: int = 1
    compiler: bool = False  # it compiles (flex attention, Triton kernels) on the GPU
    shm_mib: float = 0.0


# A section not named here (a new one) needs what a launched run needs, on one GPU.
SECTION_NEEDS: dict[str, Needs] = {
    "cuda_ipc_tests": Needs(modules=(*RUNTIME_MODULES, "pytest"), shm_mib=256),
    "pin_refusal": Needs(modules=RUNTIME_MODULES, shm_mib=16),
    "auto_choice": Needs(shm_mib=64),
    "nccl_init": Needs(modules=("torch",)),
    "ipc_handoff": Needs(modules=RUNTIME_MODULES),
    "pinned_shm": Needs(modules=RUNTIME_MODULES, shm_mib=256),
    "eagle3_step": Needs(modules=RUNTIME_MODULES),
    "resume": Needs(modules=RUNTIME_MODULES, compiler=True),
    "flex_recompiles": Needs(modules=RUNTIME_MODULES, compiler=True),
    "launch": Needs(compiler=True, shm_mib=64),
    "target_restart": Needs(shm_mib=64),
    "dflash_step": Needs(modules=RUNTIME_MODULES, compiler=True),
    "capture": Needs(modules=RUNTIME_MODULES),
    "nccl_group": Needs(gpus=2, compiler=True, shm_mib=64),
    "tp_target": Needs(modules=(*RUNTIME_MODULES, "accelerate"), gpus=2),  # Transformers' TP loading needs it
}


def needs_of(name: str) -> Needs:
    return SECTION_NEEDS.get(name, Needs())


def unmet(needs: Needs, facts: dict[str, Any]) -> str | None:
    """Why a section with ``needs`` cannot run on the host the preflight ``facts`` describe; None: it can."""
    gpus = len(facts.get("cuda", {}).get("gpus", []))
    if needs.gpus and not gpus:
        return NO_CUDA
    if gpus < needs.gpus:
        return f"needs {needs.gpus} GPUs, this host has {gpus}"
    missing = [name for name in needs.modules if not facts["modules"].get(name, {}).get("found")]
    if missing:
        why = "; ".join(f"{name}: {facts['modules'].get(name, {}).get('error', 'not checked')}" for name in missing)
        return f"missing modules {', '.join(missing)} ({why}): make gpu-wheels carries them (docs/gpu-check.md)"
    if needs.compiler and not facts["compiler"]["ok"]:
        return f"Triton compiles here and needs a C compiler and Python.h: {facts['compiler']['problem']}"
    shm = facts.get("shm", {}).get("total_mib")
    if needs.shm_mib and shm is not None and shm < needs.shm_mib:
        return (f"/dev/shm holds {shm:.0f} MiB, it needs about {needs.shm_mib:.0f} MiB (a container's default is "
                f"64 MiB: docker run --shm-size=8g)")
    return None


def module_facts(names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each module imported here: found (it imports), its version and file, or the error that stopped it."""
    facts: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing or broken module is a fact of the host
            facts[name] = {"found": False, "error": f"{type(exc).__name__}: {exc}"}
            continue
        version = getattr(module, "__version__", None)
        if not isinstance(version, str):
            try:
                version = importlib.metadata.version(DISTRIBUTIONS.get(name, name))
            except importlib.metadata.PackageNotFoundError:
                version = None
        facts[name] = {"found": True, "version": version, "path": getattr(module, "__file__", None)}
    return facts


def compiler_facts() -> dict[str, Any]:
    """The C compiler Triton would call (``$CC``, else cc, gcc, clang on PATH) and the interpreter's ``Python.h``."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    compiler = next((found for found in map(shutil.which, candidates) if found), None)
    include = Path(sysconfig.get_paths()["include"])
    header = (include / "Python.h").is_file()
    problems = ([] if compiler else [f"no C compiler ({', '.join(candidates)}) on PATH"]) + \
        ([] if header else [f"no Python.h in {include} (the python3-dev package)"])
    return {"cc": compiler, "python_h": str(include / "Python.h") if header else None, "ok": not problems,
            "problem": "; ".join(problems) or None}


def shm_facts(path: str = "/dev/shm") -> dict[str, Any]:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": path, "error": f"{type(exc).__name__}: {exc}"}
    return {"path": path, "total_mib": round(st.f_blocks * st.f_frsize / 2**20, 1),
            "free_mib": round(st.f_bavail * st.f_frsize / 2**20, 1)}


def cuda_facts(timeout_s: float = CUDA_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """torch's view of the GPUs, from a child interpreter (a hung driver is a timeout, not a hang)."""
    try:
        proc = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"cuda": False, "error": f"the CUDA probe did not answer within {timeout_s:.0f}s (a hung driver?)"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return {"cuda": False, "error": f"the CUDA probe failed: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def preflight() -> dict[str, Any]:
    """Every fact above, as one JSON object; ``warnings`` lists what would make a section's figure misleading."""
    repo = Path(__file__).resolve().parent.parent
    started = time.monotonic()
    modules = module_facts((*LAUNCH_MODULES, *OPTIONAL_MODULES))
    cuda = cuda_facts() if modules["torch"]["found"] else {"cuda": False, "error": "torch does not import"}
    facts: dict[str, Any] = {
        "python": {"executable": sys.executable, "version": platform.python_version(),
                   "python3_on_path": shutil.which("python3"), "sys_path": sys.path},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
        "checkout": str(repo) if (repo / "tests").is_dir() else None,  # cuda_ipc_tests runs its tests
        "modules": modules, "compiler": compiler_facts(), "shm": shm_facts(), "cuda": cuda,
        "flash_attn": modules["flash_attn"]["found"],
    }
    facts["versions"] = {name: modules[name].get("version") for name in ("torch", "transformers", "triton")}
    facts["versions"]["cuda"] = cuda.get("cuda_build")
    facts["missing"] = [name for name in LAUNCH_MODULES if not modules[name]["found"]]
    facts["warnings"] = _warnings(facts)
    facts["seconds"] = round(time.monotonic() - started, 1)  # the check's budget counts from the preflight's start
    return facts


def _warnings(facts: dict[str, Any]) -> list[str]:
    warnings = []
    python3 = facts["python"]["python3_on_path"]
    if python3 and os.path.realpath(python3) != os.path.realpath(sys.executable):
        warnings.append(f"python3 on PATH is {python3}, not this interpreter ({sys.executable})")
    if facts["flash_attn"]:
        warnings.append("flash_attn is installed: target.attn_implementation=auto picks it (a path no test covers)")
    if facts["cuda"].get("gpus") and not facts["compiler"]["ok"]:
        warnings.append(f"sections that compile are skipped: {facts['compiler']['problem']}")
    return warnings


def summary(facts: dict[str, Any]) -> str:
    """One line for the progress log."""
    gpus = facts["cuda"].get("gpus", [])
    where = f"{len(gpus)} x {gpus[0]['name']}" if gpus else f"no CUDA ({facts['cuda'].get('error', 'none found')})"
    missing = f"; missing {', '.join(facts['missing'])}" if facts["missing"] else ""
    return (f"python {facts['python']['version']} ({facts['python']['executable']}), torch "
            f"{facts['versions']['torch']}, {where}, /dev/shm {facts['shm'].get('total_mib')} MiB, compiler "
            f"{'ok' if facts['compiler']['ok'] else facts['compiler']['problem']}{missing}")


def write_alone(facts: dict[str, Any], *dirs: str | None) -> list[Path]:
    """``00-preflight.json`` into each of ``dirs`` given, when the check itself cannot even be imported."""
    written = []
    for directory in filter(None, dirs):
        path = Path(directory) / "00-preflight.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(facts, indent=1))
        written.append(path)
    return written
