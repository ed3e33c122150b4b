"""The process sections of ``hsd bench gpu``: whole runs under ``hsd launch`` on this machine's GPUs.

- ``launch``: one real target and one real DFlash drafter on the one GPU, end to end, once per
  transport (``shm`` through the pinned pool, ``cuda_ipc`` device to device); the figures are the
  run's own report: exactly once by the ledger and by the models' witness (0 duplicates / 0
  missing), throughput per stage.
- ``nccl_group``: with two or more GPUs, two drafter ranks of one model (NCCL) and a target; once
  the group has formed and checkpointed, the rank that commits is SIGKILLed mid-step; the others
  must regroup and the run still finish exactly once.

The target is a small random Qwen3 with a tokenizer trained on the synthetic language, and the
data a prepared dataset of random token sequences (:func:`write_launch_inputs`): nothing is
downloaded. On the CPU the ``launch`` section runs with ``shm`` only (its reduced form, in tests).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.gpu_sections import CheckContext, Skip, save_random_qwen3

if TYPE_CHECKING:
    from common.wire.stats_snapshot import WorkerView

RUN_OVERRIDES = ("run.epochs=1", "run.seed=0", "target.capture_layers=[1,2]", "target.count=1",
                 "drafter.accum_steps=2", "drafter.checkpoint_every=2", "schedule.buckets=[32,64]",
                 "schedule.tokens_per_batch=128", "pool.slots=4", "pool.min_ready=1", "dflash.block_size=4",
                 "dflash.gamma=2.0", "dflash.num_draft_layers=1", "dflash.num_anchors=8",
                 "dispatcher.heartbeat_s=0.2", "dispatcher.worker_timeout_s=30")


def write_launch_inputs(root: Path, *, num_samples: int, hidden: int) -> tuple[Path, Path]:
    """(target directory, prepared dataset) of a small real run; reused when already written."""
    from common.run.prepared import FORMAT, MANIFEST_FILE, load_tokenizer, tokenizer_fingerprint
    from target_worker.prepare import DatasetWriter
    from target_worker.synthetic_language import make_splits
    from target_worker.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer
    import torch
    target_dir, data_dir = root / "target", root / "data"
    if not (data_dir / MANIFEST_FILE).is_file():
        train, _ = make_splits(0, num_train=200, num_heldout=0)
        texts = [text for c in train for turn in c.turns for text in turn] + ["system user assistant"]
        tokenizer = build_tokenizer(texts, vocab_size=400)
        vocab = len(tokenizer)
        save_random_qwen3(target_dir, hidden=hidden, heads=4, kv_heads=2, head_dim=hidden // 4,
                          intermediate=2 * hidden, vocab=vocab, num_layers=4, dtype="float32",
                          device=torch.device("cpu"))
        tokenizer.save_pretrained(str(target_dir))
        rng = np.random.default_rng(0)
        data_dir.mkdir(parents=True, exist_ok=True)
        writer = DatasetWriter(data_dir)
        lengths = rng.integers(12, 60, size=num_samples).tolist()
        for length in lengths:
            # Ordinary tokens only: the special ones (ids 0-3, the mask token the drafter defaults to among
            # them) never occur in real data either.
            writer.add(rng.integers(len(SPECIAL_TOKENS), vocab, size=length).tolist(), [0] * 4 + [1] * (length - 4))
        writer.finish()
        manifest = {"format": FORMAT, "num_samples": num_samples, "num_tokens": int(sum(lengths)),
                    "tokenizer": {"fingerprint": tokenizer_fingerprint(load_tokenizer(target_dir))},
                    "checksums": writer.checksums_section()}
        (data_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    return target_dir, data_dir


def run_stats_or_none(run_dir: Path):
    """A launched run's stats, or None. Its messaging (pyzmq, msgspec) is imported here, not with the module:
    ``hsd bench gpu`` imports every section before its preflight has said what the host lacks."""
    from ops.stats_view import run_stats_or_none as read
    return read(run_dir)


def _hsd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsd.cli", *args]


def _stop(proc: subprocess.Popen) -> None:
    """Kill a launch and every process it started (they share its session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _report(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(_hsd("report", "--run-dir", str(run_dir), "--json"), capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"hsd report failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _run_figures(r: dict[str, Any], *, returncode: int, wall_s: float) -> dict[str, Any]:
    figures = {"exit_code": returncode, "wall_s": round(wall_s, 1),
               **{k: r.get(k) for k in ("jobs_total", "committed", "duplicates", "lost", "steps",
                                        "witness_duplicates", "witness_missing")}}
    for stage, row in r.get("stages", {}).items():
        figures[f"{stage}_tokens_per_s"] = row.get("tokens_per_s")
    figures["exactly_once"] = bool(returncode == 0 and r.get("finished")
                                   and (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
                                   and (r["witness_duplicates"], r["witness_missing"]) == (0, 0))
    return figures


def launch_run(run_dir: Path, overrides: list[str], *, timeout_s: float) -> dict[str, Any]:
    """``hsd launch`` with ``overrides`` to its end; its exit code and ``hsd report``'s figures."""
    log_path = run_dir.parent / f"{run_dir.name}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_hsd("launch", *overrides), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"hsd launch did not finish within {timeout_s:.0f}s (log: {log_path})") from None
        finally:
            _stop(proc)
    figures = _run_figures(_report(run_dir), returncode=returncode, wall_s=time.monotonic() - started)
    if not figures["exactly_once"]:
        figures["log_tail"] = log_path.read_text(errors="replace")[-2000:]
    return figures


def launch(ctx: CheckContext) -> dict[str, Any]:
    """1 target + 1 DFlash drafter on one GPU, end to end, with each transport (shm only on the CPU)."""
    s = ctx.shapes
    target_dir, data_dir = write_launch_inputs(ctx.tmp / "launch-inputs", num_samples=s.launch_samples,
                                               hidden=s.launch_hidden)
    transports = ("shm", "cuda_ipc") if ctx.cuda else ("shm",)
    gpus = ["target.gpus=[0]", "drafter.gpus=[0]"] if ctx.cuda else []
    figures: dict[str, Any] = {}
    for transport in transports:
        run_dir = ctx.tmp / f"launch-{transport}"
        overrides = [f"run.dir={run_dir}", f"data.path={data_dir}", f"target.model={target_dir}", "drafter.count=1",
                     f"pool.transport={transport}", *RUN_OVERRIDES, *gpus]
        ctx.progress(f"launch with pool.transport={transport}")
        figures[transport] = launch_run(run_dir, overrides, timeout_s=max(30.0, min(240.0, ctx.left_s())))
    figures["witness_ok"] = all(f["exactly_once"] for f in figures.values() if isinstance(f, dict))
    return figures


# -- two NCCL ranks, one killed mid-step --------------------------------------------------------
def _committing_rank_mid_step(run_dir: Path) -> tuple[WorkerView, int] | None:
    """Rank 0 holding jobs of a step after the group's first checkpoint, and the membership version."""
    s = run_stats_or_none(run_dir)
    group, model = (s.groups.get("drafter"), s.models.get("drafter")) if s is not None else (None, None)
    if group is None or not group.formed or model is None or model.checkpoint < 2:
        return None
    holding = [w for w in s.workers if w.rank == 0 and w.held]
    return (holding[0], group.version) if holding else None


def nccl_group(ctx: CheckContext) -> dict[str, Any]:
    """Two drafter ranks over NCCL (GPUs 0 and 1) train one model; rank 0 is killed inside a step."""
    import torch
    if not ctx.cuda or torch.cuda.device_count() < 2:
        raise Skip(f"needs two GPUs, this host has {torch.cuda.device_count() if ctx.cuda else 0}")
    target_dir, data_dir = write_launch_inputs(ctx.tmp / "launch-inputs", num_samples=ctx.shapes.launch_samples,
                                               hidden=ctx.shapes.launch_hidden)
    run_dir = ctx.tmp / "nccl-group"
    overrides = [f"run.dir={run_dir}", f"data.path={data_dir}", f"target.model={target_dir}", *RUN_OVERRIDES,
                 "target.gpus=[0]", "drafter.count=2", "drafter.gpus=[0,1]", "drafter.data_parallel=true",
                 "drafter.collective_timeout_s=60", "drafter.max_restarts=2", "run.epochs=2"]
    log_path = ctx.tmp / "nccl-group.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_hsd("launch", *overrides), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + max(30.0, min(240.0, ctx.left_s()))
            found = None
            while found is None and time.monotonic() < deadline and proc.poll() is None:
                found = _committing_rank_mid_step(run_dir)
                time.sleep(0.05)
            if found is None:
                raise RuntimeError(f"rank 0 was never seen holding jobs after a checkpoint (log: {log_path})")
            victim, version = found
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            regrouped_s = None
            while time.monotonic() < deadline and proc.poll() is None:
                s = run_stats_or_none(run_dir)
                group = s.groups.get("drafter") if s is not None else None
                if group is not None and group.formed and group.version > version:
                    regrouped_s = round(time.monotonic() - killed_at, 2)
                    break
                time.sleep(0.1)
            returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            _stop(proc)
    figures = _run_figures(_report(run_dir), returncode=returncode, wall_s=time.monotonic() - started)
    figures.update(killed_rank_pid=victim.pid, killed_in_version=version, regrouped_after_s=regrouped_s)
    if not figures["exactly_once"]:
        figures["log_tail"] = log_path.read_text(errors="replace")[-2000:]
    return figures


# -- a target restart under cuda_ipc: the drafter's mapping of the dead target's block ----------------
RESTART_OVERRIDES = ("target.sim=true", "drafter.sim=true", "pool.transport=auto", "target.gpus=[0]",
                     "drafter.gpus=[0]", "target.hidden_size=4096", "target.num_capture_layers=5",
                     "schedule.tokens_per_batch=8192", "pool.slots=4", "pool.min_ready=1", "drafter.accum_steps=2",
                     "target.sim_cost_per_token=2e-5", "drafter.sim_cost_per_token=1e-6", "data.synthetic_samples=800",
                     "run.epochs=1", "target.max_restarts=1", "dispatcher.heartbeat_s=0.2",
                     "dispatcher.worker_timeout_s=5")


def _used_mib(device) -> float:
    import torch
    free, total = torch.cuda.mem_get_info(device)
    return round((total - free) / 2**20, 1)


def _workers(run_dir: Path, role: str) -> list[WorkerView]:
    s = run_stats_or_none(run_dir)
    return [w for w in s.workers if w.role == role] if s is not None else []


def target_restart(ctx: CheckContext) -> dict[str, Any]:
    """Sim target and drafter on GPU 0 under auto (cuda_ipc), 1.25 GiB of slots a target; the target is
    SIGKILLed and restarted. The GPU's used memory once the drafter reads the new target's block, vs
    before: without the release it grows by the dead target's block, which the drafter kept mapped."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    run_dir = ctx.tmp / "target-restart"
    log_path = ctx.tmp / "target-restart.log"
    block_mib = 4 * 8192 * 5 * 4096 * 2 / 2**20
    started = time.monotonic()
    deadline = started + max(30.0, min(150.0, ctx.left_s()))
    figures: dict[str, Any] = {"block_mib": block_mib}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_hsd("launch", f"run.dir={run_dir}", *RESTART_OVERRIDES), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def wait_for(what: str, predicate) -> Any:
                while time.monotonic() < deadline and proc.poll() is None:
                    found = predicate()
                    if found:
                        return found
                    time.sleep(0.1)
                raise RuntimeError(f"{what} not seen (exit code {proc.poll()}, log: {log_path})")
            drafter_jobs = lambda: sum(w.jobs for w in _workers(run_dir, "drafter"))  # noqa: E731
            victim = wait_for("a target that extracted and a drafter that read", lambda: next(
                (w for w in _workers(run_dir, "target") if w.jobs >= 4), None) if drafter_jobs() >= 4 else None)
            figures["used_before_mib"] = _used_mib(ctx.device)
            os.kill(victim.pid, signal.SIGKILL)
            killed_at, read_before = time.monotonic(), drafter_jobs()
            wait_for("the restarted target", lambda: any(w.pid != victim.pid and w.jobs >= 2
                                                         for w in _workers(run_dir, "target")))
            wait_for("the drafter reading the new target's slots", lambda: drafter_jobs() >= read_before + 4)
            time.sleep(1.0)
            figures["used_after_mib"] = _used_mib(ctx.device)
            figures["restart_to_reads_s"] = round(time.monotonic() - killed_at, 1)
            returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            _stop(proc)
    figures["growth_mib"] = round(figures["used_after_mib"] - figures["used_before_mib"], 1)
    drafter_log = (run_dir / "logs" / "drafter-0.log").read_text(errors="replace")
    dispatcher_log = (run_dir / "logs" / "dispatcher.log").read_text(errors="replace")
    figures["released_lines"] = drafter_log.count("released the CUDA IPC block")
    figures["transport"] = "cuda_ipc" if "auto chose cuda_ipc" in dispatcher_log else "not cuda_ipc"
    figures.update(_run_figures(_report(run_dir), returncode=returncode, wall_s=time.monotonic() - started))
    figures["released"] = figures["growth_mib"] < block_mib / 2 and figures["released_lines"] >= 1
    return figures
