"""Exactly-once judged by the witness (the models' own trained-job records), under the failures that
used to break it: a drafter restarting from an older checkpoint while the dispatcher runs, an fsync
that fails, and a flood of requests under other workers' ids."""

from __future__ import annotations

import os
import signal
import threading

import msgspec
import pytest

from common import faults
from common.run.records.events import ModelRolledBack
from common.run.records.journal import read_journal
from common.run.records.rundir import STATE_FILE
from common.run.witness import TrainedJobs, latest_checkpoint, list_models, save_checkpoint
from common.wire import messages
from common.wire.client import DispatcherClient, DispatcherUnavailable
from common.wire.messages import ErrorCode, ProtocolError
from dispatcher.server import FAIL_CLOSED_EXIT_CODE
from hsd_testing import hsd, report, running_hsd, sim_args, stats, wait_for_stats


def exact(r: dict) -> bool:
    return (r["committed"], r["witness_duplicates"], r["witness_missing"]) == (r["jobs_total"], 0, 0)


def test_witness_catches_a_job_trained_twice_and_one_never_trained(run_dir):
    hsd("launch", *sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=2"), timeout=300)
    r = report(run_dir)
    assert exact(r) and r["duplicates"] == 0
    # Plant both faults in one model's final record: the ledger's own figures cannot see them.
    model = list_models(run_dir)[0]
    checkpoint = latest_checkpoint(run_dir, model)
    trained = list(checkpoint.trained_jobs())
    planted = TrainedJobs(trained[1:] + [trained[-1]])   # the first job never trained, the last one twice
    save_checkpoint(run_dir, model, checkpoint.step, planted)
    r = report(run_dir)
    assert (r["witness_duplicates"], r["witness_missing"]) == (1, 1)
    assert (r["duplicates"], r["lost"]) == (0, 0)        # what the ledger alone would have said
    text = hsd("report", "--run-dir", str(run_dir)).stdout
    assert "duplicates 1  missing 1" in text


def test_drafter_restarts_from_an_older_checkpoint_while_the_dispatcher_runs(run_dir, tmp_path):
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=2", "drafter.checkpoint_every=4",
                    "target.sim_cost_per_token=3e-5")
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        def a_drafter_frozen_between_checkpoints(s):
            """A drafter stopped (SIGSTOP) while the ledger holds steps of its model past the latest
            checkpoint on disk: it can write none before it is killed."""
            for model, state in (s.get("models") or {}).items():
                victim = next((w for w in s["workers"] if w["name"] == model), None)
                if victim is None or not (state["step"] >= 5 and state["step"] > state["checkpoint"]):
                    continue
                os.kill(victim["pid"], signal.SIGSTOP)
                on_disk = latest_checkpoint(run_dir, model)
                now = stats(run_dir)
                if now and now["models"][model]["step"] > (on_disk.step if on_disk else 0):
                    return model, victim
                os.kill(victim["pid"], signal.SIGCONT)
            return None
        model, victim = wait_for_stats(run_dir, a_drafter_frozen_between_checkpoints, 120, interval=0.05,
                                       what="a model past its checkpoint")
        os.kill(victim["pid"], signal.SIGKILL)   # it comes back (hsd launch restarts it) from its checkpoint
        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    rollbacks = [e for e in read_journal(run_dir, only=(ModelRolledBack,)) if e.model == model and e.jobs]
    assert rollbacks, "the restarted drafter's commits after its checkpoint went back to pending"
    assert exact(report(run_dir))


@pytest.mark.parametrize("fault,epochs", [("disk_full_at=journal:12", 1), ("disk_full_at=snapshot:0", 2)],
                         ids=["journal", "snapshot"])
def test_a_full_disk_stops_the_run_cleanly_and_a_relaunch_finishes_exactly_once(run_dir, tmp_path, fault, epochs):
    """Disk full at the journal (a write fails mid-line) or at the first ledger snapshot (an epoch's end).
    Before: the journal's close raised out of the server's cleanup, a failed snapshot raised a bare
    RuntimeError (exit 1), and the launcher killed workers still waiting on their call."""
    args = sim_args(run_dir, f"run.epochs={epochs}", "target.count=2", "drafter.count=2")
    proc = hsd("launch", *args, timeout=400, check=False, env=dict(os.environ, **{faults.ENV: fault}))
    out = proc.stdout + proc.stderr
    # The dispatcher stopped itself with one line naming the path and the free space; the launch
    # returned its code; no process had to be killed, and no traceback anywhere.
    assert proc.returncode == FAIL_CLOSED_EXIT_CODE, out[-3000:]
    assert f"the dispatcher exited with code {FAIL_CLOSED_EXIT_CODE}" in proc.stderr
    stop_line = next(line for line in out.splitlines() if "Stopping (fail closed)" in line)
    place = "journal.jsonl" if "journal" in fault else "state.json"
    assert place in stop_line and "No space left on device" in stop_line and "free on its filesystem" in stop_line
    assert "did not stop within" not in out and "Traceback" not in out
    assert not (run_dir / STATE_FILE).exists() and not list((run_dir / "snapshots").glob(".tmp*"))
    r = report(run_dir)
    assert not r["finished"] and r["witness_duplicates"] == 0
    hsd("launch", *args, timeout=300)        # the space is back: the same command resumes
    assert exact(report(run_dir))


FORGED = (messages.GetJob(wait_ms=0), messages.Heartbeat(holding=[]), messages.Deregister(), messages.GetHS(wait_ms=0))
FORGED_ROUNDS = 25  # while the workers are paused: each op under each worker's id, this many times


def _forge(client, worker_ids, refusals: list, others: list) -> None:
    """Each op of FORGED once under each worker's id, with a token that is not theirs."""
    for worker_id in worker_ids:
        for forged in FORGED:
            request = msgspec.structs.replace(forged, worker_id=worker_id, token="forged")
            try:
                client.call(request)
                others.append(messages.op_of(request))
            except ProtocolError as exc:
                if exc.code == ErrorCode.UNAUTHORIZED:
                    refusals.append(exc.code)
                elif exc.code != ErrorCode.UNKNOWN_WORKER:   # a worker that just left
                    others.append(exc.code)
            except DispatcherUnavailable:
                pass


def test_requests_under_other_workers_ids_without_their_tokens_are_refused(run_dir, tmp_path):
    """A fixed number of forged requests while the run's workers are paused (SIGSTOP: nothing they
    hold can change meanwhile), then a flood for as long as the run lasts: every one is refused
    and nobody's work is taken away."""
    args = sim_args(run_dir, "run.epochs=1", "target.count=2", "drafter.count=2",
                    "dispatcher.worker_timeout_s=120")  # paused workers are silent, not dead
    paused_refusals, refusals, others = [], [], []
    stop = threading.Event()

    def flood():
        client = DispatcherClient(f"ipc://{run_dir / 'control.sock'}", timeout_s=2)
        try:
            while not stop.is_set():
                _forge(client, [w["id"] for w in (stats(run_dir) or {}).get("workers", [])], refusals, others)
        finally:
            client.close()

    flooder = threading.Thread(target=flood, daemon=True)
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        try:
            s = wait_for_stats(run_dir, lambda s: not s["done"] and {w["role"] for w in s["workers"]} >= {"target", "drafter"}
                               and s, 120, what="a target and a drafter registered")
            paused = s["workers"]
            for w in paused:
                os.kill(w["pid"], signal.SIGSTOP)
            try:
                client = DispatcherClient(f"ipc://{run_dir / 'control.sock'}", timeout_s=30)
                try:
                    for _ in range(FORGED_ROUNDS):
                        _forge(client, [w["id"] for w in paused], paused_refusals, others)
                finally:
                    client.close()
            finally:
                for w in paused:
                    os.kill(w["pid"], signal.SIGCONT)
            flooder.start()
            assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-3000:]
        finally:
            stop.set()
            if flooder.is_alive():
                flooder.join(timeout=10)
    assert len(paused_refusals) == FORGED_ROUNDS * len(FORGED) * len(paused) and not others, others
    r = report(run_dir)
    assert exact(r) and not r["given_back"]   # nobody's work was taken away
