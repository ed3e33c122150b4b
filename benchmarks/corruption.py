"""``hsd bench corruption``: one flipped byte in a file the run wrote, then the same launch again.

A sim run of three epochs is stopped mid-run (its dispatcher exits with a commit durable and its
answer not sent, the test fault ``dispatcher_exit_before_commit_reply``); that run directory is the
base. Each trial copies it, flips one byte at a seeded random offset of one seeded random file
among the journal's segments, the ledger snapshots and the models' checkpoints, and launches the
run again. The rule (docs/corruption.md) allows two outcomes, and the bench judges each trial:

- *resumed*: the launch ends (rc 0) and the run is exactly once by the models' own witness
  (every job committed, no duplicate, none missing), with the report agreeing with the witness;
  where a log line says the run fell back from a damaged file, that line names the flipped file;
- *refused*: the launch exits 2 and its output names the flipped file.

Anything else (another exit code, a silent skip that trains a job twice, a refusal that names
another file, a launch that runs past its time) is a failure, printed with the trial's log tail.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import faults

EPOCHS = 3
RUN_OVERRIDES = ("target.sim=true", "drafter.sim=true", "data.synthetic_samples=400", "dispatcher.heartbeat_s=0.2",
                 "dispatcher.worker_timeout_s=3", f"run.epochs={EPOCHS}", "target.count=2", "drafter.count=2",
                 "drafter.checkpoint_every=8")  # several checkpoints per model: a damaged newest one has an older
STOP_AT_STEP = 30          # the base run's dispatcher exits at the first commit of a model step >= this
TRIAL_TIMEOUT_S = 300.0
FALLBACK_WORDS = ("damaged", "falling back", "fell back")


@dataclass
class Trial:
    index: int
    file: str
    offset: int
    outcome: str = ""      # "resumed", "refused" or "FAILED: why"
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"trial": self.index, "file": self.file, "offset": self.offset, "outcome": self.outcome,
                "seconds": round(self.seconds, 1)}


def _launch(run_dir: Path, *, env: dict[str, str] | None = None, timeout: float = TRIAL_TIMEOUT_S
            ) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "hsd.cli", "launch", "--config", str(_sim_config()), f"run.dir={run_dir}",
            *RUN_OVERRIDES]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ))


def _sim_config() -> Path:
    from importlib import resources
    return Path(str(resources.files("ops.configs") / "demo-sim.yaml"))


def _report(run_dir: Path) -> dict[str, Any] | str:
    """``hsd report --json``'s figures, or its one-line refusal."""
    out = subprocess.run([sys.executable, "-m", "hsd.cli", "report", "--run-dir", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode == 2:
        return out.stderr.strip()
    if out.returncode != 0:
        raise RuntimeError(f"hsd report exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def _witness_alone(run_dir: Path) -> dict[str, Any]:
    """The models' witness against every started epoch's schedule, without the journal."""
    from common.run.records.schedule import load_schedule
    from ops.report import witness
    epochs = {}
    for epoch in range(EPOCHS):
        schedule = load_schedule(run_dir, epoch)
        if schedule is not None:
            epochs[epoch] = schedule.num_jobs
    found = witness(run_dir, epochs)
    return {**found, "jobs_total": sum(epochs.values()), "committed": found["witness_trained"]}


def candidate_files(run_dir: Path) -> list[Path]:
    """The files a flipped byte is tried in: journal segments, snapshot files, checkpoint files."""
    found = sorted(run_dir.glob("journal*.jsonl")) + sorted(run_dir.glob("snapshots/snap-*/*"))
    found += sorted(p for p in run_dir.glob("models/*/step-*/**/*") if p.is_file())
    return [p for p in found if p.is_file() and p.stat().st_size > 0]


def make_base(work_dir: Path) -> Path:
    base = work_dir / "base"
    env = dict(os.environ, **{faults.ENV: f"dispatcher_exit_before_commit_reply={STOP_AT_STEP}"})
    proc = _launch(base, env=env)
    if proc.returncode == 0:
        raise RuntimeError("the base run finished before its dispatcher was stopped")
    for marker in base.glob("test-fault-*"):
        marker.unlink()
    _sweep_shared_memory(base)
    return base


def _sweep_shared_memory(run_dir: Path) -> None:
    """The stopped base run's segments (its dispatcher exited without closing them); a trial's own are
    swept by its launch, which runs under another run id."""
    from common.dataplane.shm_segment import sweep_dead_segments
    from common.wire.client import run_id_for
    sweep_dead_segments(run_id_for(run_dir))


def judge(trial: Trial, run_dir: Path, proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    flipped = trial.file
    if proc.returncode == 2:
        return "refused" if flipped in out else "FAILED: refused without naming the flipped file"
    if proc.returncode != 0:
        return f"FAILED: launch exited {proc.returncode}"
    fallback_lines = [line for line in out.splitlines() if any(w in line for w in FALLBACK_WORDS)]
    if fallback_lines and not any(Path(flipped).name in line for line in fallback_lines):
        return "FAILED: fell back without naming the flipped file"
    r = _report(run_dir)
    refusal = r if isinstance(r, str) else None
    if refusal is not None:  # the run resumed from a snapshot past the damage; the report reads every segment
        if flipped not in refusal:
            return f"FAILED: hsd report refused without naming the flipped file: {refusal[-200:]}"
        r = _witness_alone(run_dir)
    exact = (r["committed"], r["witness_duplicates"], r["witness_missing"]) == (r["jobs_total"], 0, 0)
    if not exact:
        return (f"FAILED: not exactly once (committed {r['committed']} of {r['jobs_total']}, witness duplicates "
                f"{r['witness_duplicates']} missing {r['witness_missing']})")
    if refusal is None and (r["duplicates"], r["lost"]) != (0, 0):
        return f"FAILED: the report says duplicates {r['duplicates']} lost {r['lost']}, the witness 0 / 0"
    return "resumed" if refusal is None else "resumed (hsd report refused, naming the file)"


def run_corruption_bench(*, trials: int, seed: int, work_dir: str | None, as_json: bool, keep: bool) -> int:
    root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="hsd-corruption-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    started = time.monotonic()
    base = make_base(root)
    candidates = [p.relative_to(base) for p in candidate_files(base)]
    if not as_json:
        print(f"base run {base}: stopped mid-run, {len(candidates)} files to damage", flush=True)
    results: list[Trial] = []
    for index in range(trials):
        run_dir = root / f"trial-{index:02d}"
        shutil.copytree(base, run_dir, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
        relative = rng.choice(candidates)
        target = run_dir / relative
        offset = rng.randrange(target.stat().st_size)
        data = bytearray(target.read_bytes())
        data[offset] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        trial = Trial(index, str(target), offset)
        t0 = time.monotonic()
        proc = None
        try:
            proc = _launch(run_dir)
            trial.outcome = judge(trial, run_dir, proc)
        except subprocess.TimeoutExpired:
            trial.outcome = f"FAILED: the launch ran past {TRIAL_TIMEOUT_S:.0f}s"
        except RuntimeError as exc:  # hsd report failed in another way than a refusal
            trial.outcome = f"FAILED: {exc}"
        _sweep_shared_memory(run_dir)
        trial.seconds = time.monotonic() - t0
        results.append(trial)
        if not as_json:
            print(f"trial {index:2d}  {str(relative):<48} byte {offset:>8}  {trial.outcome}  ({trial.seconds:.0f}s)",
                  flush=True)
            if trial.outcome.startswith("FAILED") and proc is not None:
                print("    " + "\n    ".join((proc.stdout + proc.stderr).splitlines()[-15:]), flush=True)
        if not keep and not trial.outcome.startswith("FAILED"):
            shutil.rmtree(run_dir, ignore_errors=True)
    failed = [t for t in results if t.outcome.startswith("FAILED")]
    summary = {"trials": len(results), "resumed": sum(t.outcome.startswith("resumed") for t in results),
               "refused": sum(t.outcome == "refused" for t in results), "failed": len(failed),
               "seconds": round(time.monotonic() - started, 1), "results": [t.to_json() for t in results]}
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['trials']} trials: {summary['resumed']} resumed exactly once, {summary['refused']} refused "
              f"naming the file, {summary['failed']} failed ({summary['seconds']:.0f}s)")
    if not keep and not failed:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0
