"""Data-parallel drafters end to end: two ranks of one model over gloo under `hsd launch`.

Real processes, ipc:// sockets, shared memory and a FileStore rendezvous; the drafters train the
one-layer linear model on the sim targets' slots. SIGKILL rank 0 mid-run, the rank that commits the
group's steps and saves its checkpoints: the other does not hang, the step in flight commits
nothing, the group forms again under a new membership version from the latest checkpoint, and the
models' own witness shows every job trained exactly once. A rank whose peer never comes does not
wait for it forever: past ``drafter.group_wait_s`` it leaves with an error, holding nothing.
"""

from __future__ import annotations

import os
import re
import signal

from dispatcher.journal import read_journal
from drafter_worker.group_loop import GROUP_NEVER_FORMED_EXIT
from hsd_testing import kill_tree, report, start_hsd, stats, wait_for


def _args(run_dir, *overrides: str) -> list[str]:
    return [f"run.dir={run_dir}", "target.sim=true", "target.count=2", "target.hidden_size=16",
            "target.num_capture_layers=2", "drafter.backend=linear", "drafter.count=2", "drafter.accum_steps=2",
            "drafter.checkpoint_every=4", "drafter.collective_timeout_s=60", "drafter.max_restarts=2",
            "data.synthetic_samples=160", "run.epochs=1", "dispatcher.heartbeat_s=0.2",
            "dispatcher.worker_timeout_s=5", *overrides]


VICTIM_RANK = 0  # the rank that commits the group's steps: the harder one to lose


def _group(s):
    return (s or {}).get("groups", {}).get("drafter")


def test_sigkilled_committing_rank_aborts_the_step_and_the_group_resumes_from_its_checkpoint(run_dir, tmp_path):
    launch = start_hsd("launch", *_args(run_dir, "target.sim_cost_per_token=2e-5"), log_path=tmp_path / "launch.log")
    try:
        def victim_mid_step():
            s = stats(run_dir)
            group = _group(s)
            model = s["models"].get("drafter", {}) if s else {}
            # mid-way between checkpoints: the regroup must roll committed steps back
            if not group or not group["formed"] or model.get("checkpoint", 0) < 4 or model["step"] % 4 not in (1, 2):
                return None
            holding = [w for w in s["workers"] if w.get("rank") == VICTIM_RANK and w["held"]]
            return (holding[0], group["version"], s["models"]["drafter"]) if holding else None

        def frozen_victim():
            """Stop the victim, then take the snapshot again: what it holds can no longer change
            between the snapshot and the kill (a commit landing in between would name them)."""
            found = victim_mid_step()
            if not found:
                return None
            os.kill(found[0]["pid"], signal.SIGSTOP)
            again = victim_mid_step()
            if again and again[0]["pid"] == found[0]["pid"]:
                return again
            os.kill(found[0]["pid"], signal.SIGCONT)
            return None
        victim, version, model = wait_for(frozen_victim, 240, interval=0.05,
                                          what=f"rank {VICTIM_RANK} holding jobs after a checkpoint")
        os.kill(victim["pid"], signal.SIGKILL)
        regrouped = wait_for(lambda: (lambda g: g if g and g["formed"] and g["version"] > version else None)(
            _group(stats(run_dir))), 120, what="the group to form again")
        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    finally:
        kill_tree(launch)
    r = report(run_dir)
    assert (r["committed"], r["duplicates"], r["lost"]) == (r["jobs_total"], 0, 0)
    assert (r["witness_duplicates"], r["witness_missing"]) == (0, 0)   # judged by the model itself

    events = list(read_journal(run_dir))
    # The victim's uncommitted jobs went back, and no commit named them before they did.
    given_back = [i for i, e in enumerate(events) if e["ev"] == "give_back" and e["job"] in victim["held"]]
    assert given_back
    first_back = given_back[0]
    assert not any(e["ev"] == "commit" and set(e["jobs"]) & set(victim["held"]) for e in events[:first_back])
    # The group changed, and the ledger went back to the checkpoint the ranks reloaded.
    assert any(e["ev"] == "membership" and e["model"] == "drafter" for e in events[first_back - 5:])
    rollbacks = [e for e in events[first_back:] if e["ev"] == "rollback" and e["model"] == "drafter"]
    assert rollbacks, "the ledger was not rolled back to the checkpoint"
    assert model["checkpoint"] <= rollbacks[0]["step"] < model["step"] and rollbacks[0]["jobs"] > 0
    # Every step after the regroup was committed once by the group, naming both ranks' micro-batches.
    commits = [e for e in events if e["ev"] == "commit" and e.get("membership") == regrouped["version"]]
    assert commits and max(len(e["jobs"]) for e in commits) == 4
    # The surviving rank stayed up (it re-formed in-process); only the victim was restarted.
    launch_log = (tmp_path / "launch.log").read_text()
    assert launch_log.count("exited with code") == 1, launch_log[-3000:]
    survivor_log = "".join(p.read_text() for p in (run_dir / "logs").glob("drafter-*.log"))
    assert "joins the group again" in survivor_log
    assert "all-reduce wait" in survivor_log
    assert r["group_steps"] == r["steps"] and r["memberships"] >= 2 and 0 < r["allreduce_wait_share"] < 1


def test_a_rank_whose_peer_never_comes_gives_up_after_group_wait_s(run_dir, tmp_path):
    """One rank of a 2-rank group against a real dispatcher and a sim target; its peer never starts.
    Each rendezvous gives up after 1 s and the rank registers again: the wait spans them all."""
    overrides = _args(run_dir, "drafter.group_wait_s=3", "drafter.collective_timeout_s=1")
    procs = []
    try:
        dispatcher = start_hsd("dispatcher", *overrides, log_path=tmp_path / "dispatcher.log")
        procs.append(dispatcher)
        target = start_hsd("target", *overrides, "--name", "target-0", log_path=tmp_path / "target.log")
        procs.append(target)
        wait_for(lambda: (lambda s: s and s["jobs_by_state"]["ready"] > 0)(stats(run_dir)), 120,
                 what="jobs ready for the drafters")
        rank = start_hsd("drafter", *overrides, "--name", "drafter-0", log_path=tmp_path / "drafter.log")
        procs.append(rank)
        code = rank.wait(timeout=120)
        log_text = (tmp_path / "drafter.log").read_text()
        assert code == GROUP_NEVER_FORMED_EXIT, log_text[-3000:]
        gave_up = re.search(r"model drafter: the data-parallel group did not form within drafter\.group_wait_s=3s: "
                            r"1 of 2 ranks came to the rendezvous of membership (\d+)", log_text)
        assert gave_up, log_text[-3000:]
        assert int(gave_up[1]) >= 2 and "registering again" in log_text  # several rendezvous, one bounded wait

        # The dispatcher still serves; the rank left (its version ended with it) and holds nothing.
        assert dispatcher.poll() is None
        s = stats(run_dir)
        assert s is not None and not [w for w in s["workers"] if w["role"] == "drafter"]
        assert s["jobs_by_state"]["training"] == s["jobs_by_state"]["consumed"] == 0
        assert s["jobs_by_state"]["committed"] == 0 and s["jobs_by_state"]["ready"] > 0
        group = s["groups"]["drafter"]
        assert group["version"] > int(gave_up[1]) and not group["members"]

        for proc in (target, dispatcher):  # a clean stop: nothing of the run is left behind
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            kill_tree(proc)
