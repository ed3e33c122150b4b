"""``hsd bench gpu``: one command that runs every GPU path of the project and prints its figures.

Sections, in order (each returns a dict of figures; :mod:`benchmarks.gpu_sections`,
:mod:`benchmarks.gpu_launch`):

- ``ipc_handoff``: CUDA IPC slot handoff between two processes vs a device-to-device copy;
- ``pinned_shm``: a slot written into and read out of the pinned shm pool vs plain D2H / H2D
  copies, and how much of a drafter's slot copy hides under compute;
- ``capture``: capture of a bf16 Qwen3 with 8B-like layers (hidden 4096, 32 heads, random
  weights) vs the plain forward, tok/s per bucket;
- ``dflash_step``: DFlash optimizer steps at 8B-like shapes with compiled flex attention: tok/s,
  peak memory, an MFU estimate;
- ``launch``: 1 target + 1 DFlash drafter under ``hsd launch`` on the one GPU, with each transport,
  exactly once by the witness;
- ``nccl_group``: with two or more GPUs, a 2-rank NCCL group step and a rank killed inside it.

Each section runs under its own ``try``: one that fails reports its error and the others still
run. The whole check keeps to a time budget (``--budget-s``, 450 s by default, so that it ends
within 8 minutes on one GPU): a section that would start with less than its usual time left is
skipped, saying so. Without CUDA the command says so and exits 0. Exit code 1 when a section failed.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import gpu_launch, gpu_sections
from benchmarks.gpu_sections import CheckContext

BUDGET_S = 450.0

Section = tuple[str, Callable[[CheckContext], dict[str, Any]], float]
# (name, function, seconds it needs at least on one GPU: below that much time left it is skipped)
SECTIONS: list[Section] = [
    ("ipc_handoff", gpu_sections.ipc_handoff, 20.0),
    ("pinned_shm", gpu_sections.pinned_shm, 10.0),
    ("capture", gpu_sections.capture, 40.0),
    ("dflash_step", gpu_sections.dflash_step, 60.0),
    ("launch", gpu_launch.launch, 90.0),
    ("nccl_group", gpu_launch.nccl_group, 90.0),
]
SECTION_NAMES = [name for name, _, _ in SECTIONS]


def _progress(message: str) -> None:
    print(f"[bench gpu] {message}", file=sys.stderr, flush=True)


def run_sections(sections: list[Section], ctx: CheckContext) -> dict[str, dict[str, Any]]:
    """Every section's figures, ``{"error": ...}`` for one that raised, ``{"skipped": ...}`` past the budget."""
    results: dict[str, dict[str, Any]] = {}
    for name, fn, needs_s in sections:
        if ctx.left_s() < needs_s:
            results[name] = {"skipped": f"{ctx.left_s():.0f}s of the budget left, it needs about {needs_s:.0f}s"}
            _progress(f"{name}: skipped ({results[name]['skipped']})")
            continue
        _progress(f"{name} ...")
        started = time.monotonic()
        try:
            figures = dict(fn(ctx))
        except Exception as exc:  # noqa: BLE001 - a section's failure is its figure; the next one runs
            figures = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
            _progress(f"{name}: FAILED: {figures['error']}")
        figures["seconds"] = round(time.monotonic() - started, 1)
        results[name] = figures
        if ctx.cuda:
            torch.cuda.empty_cache()
    return results


def _no_cuda() -> dict[str, Any]:
    return {"cuda": False, "torch": torch.__version__, "sections": {},
            "message": f"no CUDA device on this machine (torch {torch.__version__}): nothing measured; "
                       f"run hsd bench gpu on a GPU host"}


def run_check(*, budget_s: float = BUDGET_S, only: list[str] | None = None) -> dict[str, Any]:
    unknown = sorted(set(only or []) - set(SECTION_NAMES))
    if unknown:
        raise ValueError(f"--only: unknown section(s) {', '.join(unknown)}; the sections are {', '.join(SECTION_NAMES)}")
    if not torch.cuda.is_available():
        return _no_cuda()
    device = torch.device("cuda", 0)
    sections = [s for s in SECTIONS if not only or s[0] in only]
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hsd-bench-gpu-") as tmp:
        ctx = CheckContext(device=device, tmp=Path(tmp), deadline=began + budget_s, progress=_progress)
        results = run_sections(sections, ctx)
    return {"cuda": True, "device": torch.cuda.get_device_name(device), "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda_version": torch.version.cuda, "budget_s": budget_s,
            "elapsed_s": round(time.monotonic() - began, 1), "sections": results,
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


def run_gpu_bench(*, as_json: bool, budget_s: float = BUDGET_S, only: list[str] | None = None) -> int:
    if budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {budget_s}")
    result = run_check(budget_s=budget_s, only=only)
    print(json.dumps(result) if as_json else format_check(result))
    return 1 if result.get("failed") else 0
