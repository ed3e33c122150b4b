"""``hsd bench gpu``: one command that runs every GPU path of the project and returns its figures.

First a preflight (:mod:`benchmarks.gpu_preflight`): what this host has, written as
``00-preflight.json`` before anything else; a section whose needs the host lacks (a module, CUDA,
a second GPU, a compiler for Triton, room in ``/dev/shm``) is skipped with that reason. Then the
sections, cheapest and most informative first (each returns a dict of figures;
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

Each section runs in a process of its own under a hard deadline (:data:`SECTIONS`' seconds,
:mod:`benchmarks.gpu_isolation`): one that fails reports its error, one past its deadline is
killed with everything it started and reports ``timed_out``, and the others still run. A section
starts only if its deadline fits in what is left of the budget (``--budget-s``, 450 s by
default), so the check never runs past it; the plan (which sections fit even if every one takes
its whole deadline) is in the result. With ``--out DIR`` each section's JSON is written there as
soon as it ends (``NN-name.json``), with the logs of a failed section beside it
(``NN-name-logs/``); ``--bundle DIR`` also rewrites, after every section, ``bench-gpu.json`` (all
sections so far) and ``bench-gpu.tar.gz`` (the ``--out`` files). SIGTERM or SIGINT writes what
finished, marks the running section ``interrupted`` and the rest ``skipped``, stops every process
the check started and exits 128 + the signal. Without CUDA every section is ``skipped: no CUDA``
and the command exits 0. Exit code 1 when a section failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import gpu_checks, gpu_launch, gpu_sections
from benchmarks.gpu_isolation import (Interrupted, become_subreaper, interrupt_on_signals, run_in_process, stand_in,
                                      stop_descendants, sweep_shared_memory)
from benchmarks.gpu_preflight import NO_CUDA, Needs, needs_of, unmet
from benchmarks.gpu_sections import CheckContext, Skip
from common import faults
from common.run.durable import atomic_write

BUDGET_S = 450.0
PREFLIGHT = "00-preflight"

Section = tuple[str, Callable[[CheckContext], dict[str, Any]], float]
# (name, function, its hard deadline in seconds on one GPU, its process's start included: it starts only
# with that much of the budget left, and is killed at it)
SECTIONS: list[Section] = [
    ("cuda_ipc_tests", gpu_checks.cuda_ipc_tests, 45.0),
    ("pin_refusal", gpu_checks.pin_refusal, 15.0),
    ("auto_choice", gpu_checks.auto_choice, 40.0),
    ("nccl_init", gpu_checks.nccl_init, 30.0),
    ("ipc_handoff", gpu_sections.ipc_handoff, 30.0),
    ("pinned_shm", gpu_sections.pinned_shm, 20.0),
    ("eagle3_step", gpu_checks.eagle3_step, 40.0),
    ("resume", gpu_checks.resume, 50.0),
    ("flex_recompiles", gpu_checks.flex_recompiles, 45.0),
    ("launch", gpu_launch.launch, 90.0),
    ("target_restart", gpu_launch.target_restart, 60.0),
    ("dflash_step", gpu_sections.dflash_step, 60.0),
    ("capture", gpu_sections.capture, 40.0),
    ("nccl_group", gpu_launch.nccl_group, 100.0),
    ("tp_target", gpu_sections.tp_target, 90.0),
]
SECTION_NAMES = [name for name, _, _ in SECTIONS]
STAND_IN_NEEDS = Needs(modules=(), gpus=0)  # the CPU stand-in of a section that launches a run (tests)


def _progress(message: str) -> None:
    print(f"[bench gpu] {message}", file=sys.stderr, flush=True)


def section_function(name: str) -> Callable[[CheckContext], dict[str, Any]]:
    """A section's function by name (a section's own process finds its work so)."""
    if name == "stand_in":
        return stand_in
    return next(fn for section, fn, _ in SECTIONS if section == name)


def _stand_in() -> list[Section]:
    """``HSD_TEST_FAULTS=bench_gpu_stand_in=SECONDS``: a CPU section that launches processes in a session
    of their own and waits, with that deadline, first in the plan (how the deadline and SIGTERM are tested)."""
    deadline_s = faults.active().get("bench_gpu_stand_in")
    return [] if deadline_s is None else [("stand_in", stand_in, deadline_s)]


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

    def preflight(self, facts: dict[str, Any]) -> None:
        """``00-preflight.json``, before any section (and into the bundle's files)."""
        self.meta["preflight"] = facts
        if self.out is not None:
            _write_json(self.out / f"{PREFLIGHT}.json", facts)
        self._bundle()

    def section(self, name: str, figures: dict[str, Any], logs: list[Path] = ()) -> None:
        self.results[name] = figures
        if self.out is not None:
            _write_json(self.out / f"{self.file_name(name)}.json", {"section": name, **figures})
            if logs:
                kept = self.out / f"{self.file_name(name)}-logs"
                kept.mkdir(exist_ok=True)
                for number, log in enumerate(logs):
                    shutil.copyfile(log, kept / f"{number:02d}-{log.name}")
        self._bundle()

    def _bundle(self) -> None:
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


def run_one(name: str, fn: Callable[[CheckContext], dict[str, Any]], ctx: CheckContext) -> dict[str, Any]:
    """One section's figures: ``{"skipped": ...}`` if it cannot run here, ``{"error": ...}`` if it raised."""
    try:
        return dict(fn(ctx))
    except Skip as exc:
        _progress(f"{name}: skipped ({exc})")
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a section's failure is its figure; the next one runs
        _progress(f"{name}: FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}


def plan(sections: list[Section], budget_s: float) -> dict[str, Any]:
    """The sections that fit the budget even if each takes its whole deadline (in order), and the
    rest, which run only if time is left then."""
    planned, later, worst = [], [], 0.0
    for name, _, deadline_s in sections:
        if worst + deadline_s <= budget_s:
            planned.append(name)
            worst += deadline_s
        else:
            later.append(name)
    return {"budget_s": budget_s, "planned": planned, "worst_case_s": worst, "if_time_is_left": later}


def run_sections(sections: list[Section], ctx: CheckContext, output: Output | None = None, *,
                 facts: dict[str, Any] | None = None, isolate: bool = False, tiny: bool = False
                 ) -> dict[str, dict[str, Any]]:
    """Every section's figures, ``{"error": ...}`` for one that raised or overran, ``{"skipped": ...}``
    for one past the budget or whose needs ``facts`` (the preflight's) says this host lacks; each
    handed to ``output`` as it ends. ``isolate``: each in its own process, killed at its deadline.
    :class:`Interrupted` (SIGTERM, SIGINT) marks the running one and the rest, then propagates."""
    results: dict[str, dict[str, Any]] = {}
    running: tuple[str, float] | None = None

    def done(name: str, figures: dict[str, Any], logs: list[Path] = ()) -> None:
        results[name] = figures
        if output is not None:
            output.section(name, figures, logs)
    try:
        for name, fn, deadline_s in sections:
            needs = STAND_IN_NEEDS if name == "stand_in" else needs_of(name)
            reason = unmet(needs, facts) if facts is not None else None
            if reason is None and ctx.left_s() < deadline_s:
                reason = f"{ctx.left_s():.0f}s of the budget left, its deadline is {deadline_s:.0f}s"
            if reason is not None:
                if reason != NO_CUDA:
                    _progress(f"{name}: skipped ({reason})")
                done(name, {"skipped": reason})
                continue
            _progress(f"{name} ...")
            started, wall = time.monotonic(), time.time() - 1.0
            running = (name, started)
            if isolate:
                figures = run_in_process(name, device=str(ctx.device), tmp=ctx.tmp, deadline_s=deadline_s, tiny=tiny,
                                         progress=_progress)
            else:
                figures = run_one(name, fn, ctx)
                if ctx.cuda:
                    torch.cuda.empty_cache()
            running = None
            figures["seconds"] = round(time.monotonic() - started, 1)
            done(name, figures, _logs_since(ctx.tmp, wall) if "error" in figures else [])
    except Interrupted as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stopped = stop_descendants() if isolate else []
        if isolate:
            sweep_shared_memory()
        if results:  # the last one to finish, in case the signal came while its file was written
            last = next(reversed(results))
            done(last, results[last])
        if running is not None:
            name, started = running
            done(name, {"interrupted": f"{exc} after {time.monotonic() - started:.1f}s: stopped, with the "
                                       f"{len(stopped)} process(es) it started", "seconds": round(time.monotonic() -
                                                                                                  started, 1)})
        for name, _, _ in sections:
            if name not in results:
                done(name, {"skipped": f"the check was interrupted ({exc}) before it"})
        _progress(f"interrupted by {exc}: {len(results)} section file(s) written, {len(stopped)} process(es) stopped")
        raise
    return results


def _meta(facts: dict[str, Any], budget_s: float) -> dict[str, Any]:
    gpus = facts["cuda"].get("gpus", [])
    meta: dict[str, Any] = {"cuda": bool(gpus), "torch": facts["versions"]["torch"], "budget_s": budget_s}
    if gpus:
        meta.update(device=gpus[0]["name"], num_gpus=len(gpus), cuda_version=facts["versions"]["cuda"])
    return meta


def run_check(*, budget_s: float = BUDGET_S, only: list[str] | None = None, out: str | None = None,
              bundle: str | None = None, facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The preflight (``facts``, if the caller already has it), then the sections, each in its own process."""
    from benchmarks.gpu_preflight import preflight, summary
    unknown = sorted(set(only or []) - set(SECTION_NAMES))
    if unknown:
        raise ValueError(f"--only: unknown section(s) {', '.join(unknown)}; the sections are {', '.join(SECTION_NAMES)}")
    began = time.monotonic() - (facts or {}).get("seconds", 0.0)  # the budget counts from the preflight's start
    sections = _stand_in() + [s for s in SECTIONS if not only or s[0] in only]
    if bundle and not out:  # the bundle's tarball is made of the section files
        out = tempfile.mkdtemp(prefix="hsd-bench-gpu-out-")
    facts = facts if facts is not None else preflight()
    _progress(f"preflight: {summary(facts)}")
    meta = _meta(facts, budget_s)
    output = Output(out, bundle, meta)
    output.preflight(facts)
    runnable = [s for s in sections if unmet(STAND_IN_NEEDS if s[0] == "stand_in" else needs_of(s[0]), facts) is None]
    meta["plan"] = plan(runnable, budget_s - (time.monotonic() - began))
    device = torch.device("cuda", 0) if meta["cuda"] else torch.device("cpu")
    become_subreaper()
    restore = interrupt_on_signals()
    interrupted = None
    try:
        with tempfile.TemporaryDirectory(prefix="hsd-bench-gpu-") as tmp:
            ctx = CheckContext(device=device, tmp=Path(tmp), deadline=began + budget_s, progress=_progress)
            try:
                results = run_sections(sections, ctx, output, facts=facts, isolate=True)
            except Interrupted as exc:
                results, interrupted = output.results, exc.signum
    finally:
        restore()
    result = {**meta, "elapsed_s": round(time.monotonic() - began, 1), "sections": results,
              "failed": [name for name, r in results.items() if "error" in r]}
    if interrupted is not None:
        result["interrupted"] = signal.Signals(interrupted).name
    if not meta["cuda"]:
        result["message"] = (f"no CUDA device on this machine (torch {meta['torch']}): nothing measured; "
                             f"run hsd bench gpu on a GPU host")
    return result


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, dict):
        return "  ".join(f"{k}={_value(v)}" for k, v in value.items() if k != "log_tail")
    return str(value)


def format_check(result: dict[str, Any]) -> str:
    if not result["cuda"] and not any("skipped" not in r for r in result["sections"].values()):
        return f"hsd bench gpu: {result['message']}"
    head = (f"{result['device']} × {result['num_gpus']}, torch {result['torch']} (CUDA {result['cuda_version']})"
            if result["cuda"] else f"no CUDA, torch {result['torch']}")
    lines = [f"{head}, {result['elapsed_s']:.0f}s of a {result['budget_s']:.0f}s budget"]
    for name, figures in result["sections"].items():
        lines.append("")
        lines.append(f"{name}:")
        for key, value in figures.items():
            if key not in ("traceback", "log_tail"):
                lines.append(f"  {key:<22} {_value(value)}")
    if result["failed"]:
        lines += ["", f"FAILED: {', '.join(result['failed'])}"]
    if result.get("interrupted"):
        lines += ["", f"INTERRUPTED by {result['interrupted']}"]
    return "\n".join(lines)


def run_gpu_bench(*, as_json: bool, budget_s: float = BUDGET_S, only: list[str] | None = None,
                  out: str | None = None, bundle: str | None = None, facts: dict[str, Any] | None = None) -> int:
    if budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {budget_s}")
    result = run_check(budget_s=budget_s, only=only, out=out, bundle=bundle, facts=facts)
    print(json.dumps(result) if as_json else format_check(result))
    if result.get("interrupted"):
        return 128 + signal.Signals[result["interrupted"]].value
    return 1 if result.get("failed") else 0
