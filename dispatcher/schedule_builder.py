"""Builds and writes the next epoch's schedule ahead of time, in a process of its own.

A million-job epoch takes seconds to order and write; done inside a request it would stall every
worker past its timeout, and done on a thread it would still hold the GIL the event loop needs. So
the dispatcher asks for epoch ``e + 1`` as soon as ``e`` starts, a child process
(``python -m dispatcher.schedule_builder``) builds it from the run's lengths
(``run_dir/lengths.npy``) and writes it, and the dispatcher only maps the finished files when the
epoch begins. A plain child process, not a multiprocessing pool: nothing is left behind (no
semaphores in /dev/shm) when a dispatcher is SIGKILLed, and the child dies with it.
``inline=True`` builds in the caller (tests and tools).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common.child_process import die_with_parent
from common.run.records.rundir import LENGTHS_FILE, read_run_lengths
from common.run.records.schedule import build_epoch_schedule, load_schedule, save_schedule


@dataclass(frozen=True)
class ScheduleSpec:
    buckets: tuple[int, ...]
    tokens_per_batch: int
    run_seed: int
    order: str
    batching: str = "sorted"


def build_and_save(run_dir: str, epoch: int, spec: ScheduleSpec) -> int:
    """Build epoch ``epoch`` from the run's lengths and write it; returns its job count."""
    existing = load_schedule(run_dir, epoch)
    if existing is not None:
        return existing.num_jobs
    lengths = read_run_lengths(run_dir)
    if lengths is None:
        raise FileNotFoundError(f"{Path(run_dir) / LENGTHS_FILE} is missing: the dispatcher writes it before any schedule")
    schedule = build_epoch_schedule(lengths, bucket_max_lens=list(spec.buckets), tokens_per_batch=spec.tokens_per_batch,
                                    run_seed=spec.run_seed, epoch=epoch, order=spec.order, batching=spec.batching)
    if schedule.num_jobs == 0:
        raise ValueError("the schedule holds no job: every sample is longer than the last bucket")
    save_schedule(schedule, run_dir)
    return schedule.num_jobs


class ScheduleBuilder:
    def __init__(self, run_dir, spec: ScheduleSpec, *, inline: bool = False):
        self.run_dir = str(run_dir)
        self.spec = spec
        self.inline = inline
        self._children: dict[int, subprocess.Popen] = {}
        self._built: set[int] = set()

    def request(self, epoch: int) -> None:
        """Start building ``epoch`` unless it is built or under way."""
        if epoch in self._built or epoch in self._children:
            return
        if self.inline:
            build_and_save(self.run_dir, epoch, self.spec)
            self._built.add(epoch)
            return
        self._children[epoch] = subprocess.Popen(
            [sys.executable, "-m", "dispatcher.schedule_builder", self.run_dir, str(epoch), json.dumps(asdict(self.spec))],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent)

    def requested(self, epoch: int) -> bool:
        return epoch in self._built or epoch in self._children

    def ready(self, epoch: int) -> bool:
        """Whether ``epoch`` is written (raises what the build raised); requests it if nobody did."""
        self.request(epoch)
        if epoch in self._built:
            return True
        child = self._children[epoch]
        if child.poll() is None:
            return False
        self._settle(epoch, child)
        return True

    def wait(self, epoch: int) -> None:
        self.request(epoch)
        if epoch not in self._built:
            child = self._children[epoch]
            child.wait()
            self._settle(epoch, child)

    def _settle(self, epoch: int, child: subprocess.Popen) -> None:
        error = child.stderr.read().decode(errors="replace").strip() if child.stderr else ""
        if child.stderr:
            child.stderr.close()
        del self._children[epoch]
        if child.returncode != 0:
            last = error.splitlines()[-1] if error else f"exit code {child.returncode}"
            raise ValueError(f"building the schedule of epoch {epoch} failed: {last}")
        self._built.add(epoch)

    def close(self) -> None:
        for child in self._children.values():
            child.kill()
            child.wait()
            if child.stderr:
                child.stderr.close()
        self._children.clear()


def main(argv: list[str]) -> int:
    run_dir, epoch, spec = argv[0], int(argv[1]), json.loads(argv[2])
    build_and_save(run_dir, epoch, ScheduleSpec(tuple(spec["buckets"]), spec["tokens_per_batch"], spec["run_seed"],
                                                spec["order"], spec["batching"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
