"""``hsd bench gpu``: one command that runs every GPU path of the project and returns its figures.

Sections, cheapest and most informative first (each returns a dict of figures;
:mod:`benchmarks.gpu_checks`, :mod:`benchmarks.gpu_sections`, :mod:`benchmarks.gpu_launch`):

- ``cuda_ipc_tests``: the CUDA tests of ``tests/common`` (IPC across processes and in one, pinned shm);
- ``pin_refusal``: a refused ``cudaHostRegister`` of the shm pool, and the kernel launched after it;
- ``auto_choice``: what ``pool.transport=auto`` picks here for CPU and for GPU workers, and a
  launch of CPU (sim) workers under ``auto`` on this GPU host;
- ``nccl_init``: a 1-rank NCCL group initialised (``device_id`` given) and destroyed three times;
- ``ipc_handoff``: CUDA IPC slot handoff between two processes vs a device-to-device copy;
- ``pinned_shm``: a slot written into and read out of the pinned shm pool vs plain copies;
- ``eagle3_step``: EAGLE-3 optimizer steps through its backend on the GPU;
- ``resume``: DFlash and EAGLE-3 checkpoints on the GPU resumed (fused AdamW state, CUDA RNG);
- ``flex_recompiles``: how many graphs flex attention compiles over a run of varying shapes;
- ``launch``: 1 target + 1 DFlash drafter under ``hsd launch``, with each transport, exactly once;
- ``target_restart``: a target SIGKILLed under ``cuda_ipc``, the GPU memory before and after;
- ``dflash_step``, ``capture``: DFlash steps and target capture at 8B-like shapes;
- ``nccl_group``: with two or more GPUs, a 2-rank NCCL group step and a rank killed inside it;
- ``tp_target``: with two or more GPUs, capture tok/s per GPU of one target at tp_size 1 and as a
  tensor-parallel group of 2 (NCCL); skipped, saying why, on fewer.

Each section runs under its own ``try``: one that fails reports its error and the others still
run; one that cannot run here (two GPUs on a one-GPU host) is ``skipped``. With ``--out DIR``
each section's JSON is written there as soon as it ends (``NN-name.json``, so a killed run keeps
what finished), with the logs of a failed section beside it (``NN-name-logs/``); ``--bundle DIR``
also rewrites, after every section, ``bench-gpu.json`` (all sections so far) and
``bench-gpu.tar.gz`` (the ``--out`` files): two files, whatever the number of sections. The
whole check keeps to a time budget (``--budget-s``, 450 s by default): a section that would start
with less than its usual time left is skipped, saying so. Without CUDA every section is
``skipped: no CUDA`` and the command exits 0. Exit code 1 when a section failed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import gpu_checks, gpu_launch, gpu_sections
from benchmarks.gpu_sections import CheckContext, Skip
from common.run.durable import atomic_write

BUDGET_S = 450.0
NO_CUDA = "no CUDA"

Section = tuple[str, Callable[[CheckContext], dict[str, Any]], float]
# (name, function, seconds it needs at least on one GPU: below that much time left it is skipped)
SECTIONS: list[Section] = [
    ("cuda_ipc_tests", gpu_checks.cuda_ipc_tests, 30.0),
    ("pin_refusal", gpu_checks.pin_refusal, 5.0),
    ("auto_choice", gpu_checks.auto_choice, 30.0),
    ("nccl_init", gpu_checks.nccl_init, 30.0),
    ("ipc_handoff", gpu_sections.ipc_handoff, 20.0),
    ("pinned_shm", gpu_sections.pinned_shm, 10.0),
    ("eagle3_step", gpu_checks.eagle3_step, 30.0),
    ("resume", gpu_checks.resume, 40.0),
    ("flex_recompiles", gpu_checks.flex_recompiles, 40.0),
    ("launch", gpu_launch.launch, 90.0),
    ("target_restart", gpu_launch.target_restart, 60.0),
    ("dflash_step", gpu_sections.dflash_step, 60.0),
    ("capture", gpu_sections.capture, 40.0),
    ("nccl_group", gpu_launch.nccl_group, 90.0),
    ("tp_target", gpu_sections.tp_target, 90.0),
]
SECTION_NAMES = [name for name, _, _ in SECTIONS]


def _progress(message: str) -> None:
    print(f"[bench gpu] {message}", file=sys.stderr, flush=True)


class Output:
    """Where sections land as they end: ``out`` (one JSON each), ``bundle`` (two files for all)."""

    def __init__(self, out: str | os.PathLike | None, bundle: str | os.PathLike | None, meta: dict[str, Any]):
        self.out = Path(out) if out else None
        self.bundle = Path(bundle) if bundle else None
        self.meta = meta
        self.results: dict[str, dict[str, Any]] = {}
        for path in (self.out, self.bundle):
            if path is not None:
                path.mkdir(parents=True, exist_ok=True)

    def file_name(self, name: str) -> str:
        return f"{SECTION_NAMES.index(name) + 1:02d}-{name}" if name in SECTION_NAMES else name

    def section(self, name: str, figures: dict[str, Any], logs: list[Path] = ()) -> None:
        self.results[name] = figures
        if self.out is not None:
            _write_json(self.out / f"{self.file_name(name)}.json", {"section": name, **figures})
            if logs:
                kept = self.out / f"{self.file_name(name)}-logs"
                kept.mkdir(exist_ok=True)
                for number, log in enumerate(logs):
                    shutil.copyfile(log, kept / f"{number:02d}-{log.name}")
        if self.bundle is not None:
            _write_json(self.bundle / "bench-gpu.json", {**self.meta, "sections": self.results})
            if self.out is not None:
                out = self.out

                def pack(tmp: Path) -> None:
                    with tarfile.open(tmp, "w:gz") as tar:
                        tar.add(out, arcname="bench-gpu")
                atomic_write(self.bundle / "bench-gpu.tar.gz", pack, tmp_name="bench-gpu.tar.gz.part")


def _write_json(path: Path, value: Any) -> None:
    atomic_write(path, json.dumps(value, indent=1), tmp_name=path.name + ".part")


def _logs_since(root: Path, started: float) -> list[Path]:
    """The log files under ``root`` written since ``started`` (a failed section's), newest last."""
    found = [p for p in root.rglob("*.log") if p.is_file() and p.stat().st_mtime >= started]
    return sorted(found, key=lambda p: p.stat().st_mtime)[-16:]


def run_sections(sections: list[Section], ctx: CheckContext, output: Output | None = None
                 ) -> dict[str, dict[str, Any]]:
    """Every section's figures, ``{"error": ...}`` for one that raised, ``{"skipped": ...}`` for one
    past the budget or that cannot run here; each handed to ``output`` as it ends."""
    results: dict[str, dict[str, Any]] = {}
    for name, fn, needs_s in sections:
        logs: list[Path] = []
        if ctx.left_s() < needs_s:
            figures = {"skipped": f"{ctx.left_s():.0f}s of the budget left, it needs about {needs_s:.0f}s"}
            _progress(f"{name}: skipped ({figures['skipped']})")
        else:
            _progress(f"{name} ...")
            started, wall = time.monotonic(), time.time() - 1.0
            try:
                figures = dict(fn(ctx))
            except Skip as exc:
                figures = {"skipped": str(exc)}
                _progress(f"{name}: skipped ({exc})")
            except Exception as exc:  # noqa: BLE001 - a section's failure is its figure; the next one runs
                figures = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
                _progress(f"{name}: FAILED: {figures['error']}")
                logs = _logs_since(ctx.tmp, wall)
            figures["seconds"] = round(time.monotonic() - started, 1)
            if ctx.cuda:
                torch.cuda.empty_cache()
        results[name] = figures
        if output is not None:
            output.section(name, figures, logs)
    return results


def _no_cuda(sections: list[Section], output: Output) -> dict[str, Any]:
    for name, _, _ in sections:
        output.section(name, {"skipped": NO_CUDA})
    return {**output.meta, "sections": output.results, "failed": [],
            "message": f"no CUDA device on this machine (torch {torch.__version__}): nothing measured; "
                       f"run hsd bench gpu on a GPU host"}


def run_check(*, budget_s: float = BUDGET_S, only: list[str] | None = None, out: str | None = None,
              bundle: str | None = None) -> dict[str, Any]:
    unknown = sorted(set(only or []) - set(SECTION_NAMES))
    if unknown:
        raise ValueError(f"--only: unknown section(s) {', '.join(unknown)}; the sections are {', '.join(SECTION_NAMES)}")
    sections = [s for s in SECTIONS if not only or s[0] in only]
    cuda = torch.cuda.is_available()
    if bundle and not out:  # the bundle's tarball is made of the section files
        out = tempfile.mkdtemp(prefix="hsd-bench-gpu-out-")
    meta: dict[str, Any] = {"cuda": cuda, "torch": torch.__version__, "budget_s": budget_s}
    if not cuda:
        return _no_cuda(sections, Output(out, bundle, meta))
    device = torch.device("cuda", 0)
    meta.update(device=torch.cuda.get_device_name(device), num_gpus=torch.cuda.device_count(),
                cuda_version=torch.version.cuda)
    output = Output(out, bundle, meta)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hsd-bench-gpu-") as tmp:
        ctx = CheckContext(device=device, tmp=Path(tmp), deadline=began + budget_s, progress=_progress)
        results = run_sections(sections, ctx, output)
    return {**meta, "elapsed_s": round(time.monotonic() - began, 1), "sections": results,
            "failed": [name for name, r in results.items() if "error" in r]}


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, dict):
        return "  ".join(f"{k}={_value(v)}" for k, v in value.items() if k != "log_tail")
    return str(value)


def format_check(result: dict[str, Any]) -> str:
    if not result["cuda"]:
        return f"hsd bench gpu: {result['message']}"
    lines = [f"{result['device']} × {result['num_gpus']}, torch {result['torch']} (CUDA {result['cuda_version']}), "
             f"{result['elapsed_s']:.0f}s of a {result['budget_s']:.0f}s budget"]
    for name, figures in result["sections"].items():
        lines.append("")
        lines.append(f"{name}:")
        for key, value in figures.items():
            if key not in ("traceback", "log_tail"):
                lines.append(f"  {key:<22} {_value(value)}")
    if result["failed"]:
        lines += ["", f"FAILED: {', '.join(result['failed'])}"]
    return "\n".join(lines)


def run_gpu_bench(*, as_json: bool, budget_s: float = BUDGET_S, only: list[str] | None = None,
                  out: str | None = None, bundle: str | None = None) -> int:
    if budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {budget_s}")
    result = run_check(budget_s=budget_s, only=only, out=out, bundle=bundle)
    print(json.dumps(result) if as_json else format_check(result))
    return 1 if result.get("failed") else 0
