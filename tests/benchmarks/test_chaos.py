"""benchmarks/chaos.py: `hsd bench chaos` kills every role of a real sim run and the witness holds.

A short window (12 s of serving time, about 12 events, each also due at a share of the run's
jobs: a machine faster than the plan has its targets held) on a small 3-epoch run: every role is
SIGKILLed at least once (the dispatcher included), drafters attach and detach, and the run still
finishes with every job trained exactly once by the models' own records, nothing left in /dev/shm
and no process of the run alive. The plan and the rollback figures are checked as pure code.
"""

import json

import psutil
import pytest

from benchmarks.chaos import JSON_KEYS
from benchmarks.chaos_figures import rollbacks_from_journal
from benchmarks.chaos_plan import ATTACH, DETACH, KILL, PROGRESS_SPAN, SHARES, build_plan, count_events
from common.dataplane.shm_arena import list_segments
from common.run.records.events import MembershipOpened, ModelRolledBack, StepCommitted
from common.wire.client import run_id_for
from hsd_testing import assert_session_ended, run_hsd_in_session


@pytest.mark.serial
def test_short_chaos_run_keeps_exactly_once_and_leaves_nothing(tmp_path):
    work = tmp_path / "chaos"
    run = run_hsd_in_session("bench", "chaos", "--minutes", "0.2", "--seed", "3", "--json", "--dir", str(work),
                             timeout=400)
    assert_session_ended(run.sid)
    run_dir = work / "run"
    alive = [p.pid for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not alive and not list_segments(run_id_for(run_dir))   # judged here too, not only by the bench
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"  # a run not done says why
    f = json.loads(run.stdout)
    assert set(JSON_KEYS) <= set(f)
    assert f["finished"] and f["committed"] == f["jobs_total"] > 0
    assert (f["witness_duplicates"], f["witness_missing"]) == (0, 0)
    assert (f["shm_leftover"], f["orphans"]) == (0, 0)
    assert all(f["kills"][role] >= 1 for role in ("dispatcher", "target", "drafter")), f["kills"]
    assert f["attaches"] >= 1 and f["detaches"] >= 1
    assert f["dispatcher_restarts"] == f["kills"]["dispatcher"]   # the journal saw every restart
    assert isinstance(f["steps_rolled_back"], int) and not f["crashes"]
    assert 0 < f["steps_during_window"] <= f["steps"]          # training went on under the chaos
    # one logged line per event, with its pid
    lines = (work / "chaos-events.log").read_text().splitlines()
    kills = [line for line in lines if f" {KILL} " in line]
    assert len(kills) == sum(f["kills"].values()) and all(" pid " in line for line in kills)


def test_the_plan_follows_from_the_seed_and_hits_every_role():
    plan = build_plan(seed=7, duration_s=180, mean_gap_s=9)
    assert plan == build_plan(seed=7, duration_s=180, mean_gap_s=9)
    assert plan != build_plan(seed=8, duration_s=180, mean_gap_s=9)
    counts = count_events(plan)
    assert len(plan) == 20 and all(counts[kind] >= int(20 * share) for kind, share in SHARES.items())
    assert sum(n for (action, _), n in counts.items() if action == KILL) >= 10
    assert [e.at_s for e in plan] == sorted(e.at_s for e in plan) and 0 < plan[0].at_s and plan[-1].at_s < 180
    # each event is also due at a share of the run's jobs, all of them inside the first PROGRESS_SPAN
    marks = [e.at_progress for e in plan]
    assert marks == sorted(marks) and 0 < marks[0] and marks[-1] <= PROGRESS_SPAN
    paired = build_plan(seed=7, duration_s=180, mean_gap_s=9, paired_attach=True)
    for before, after in zip(paired, paired[1:]):   # a fixed-size group takes a rank only where one left
        if after.action == ATTACH:
            assert before.action == DETACH


def test_rolled_back_steps_are_counted_from_commit_and_rollback_records():
    journal = [StepCommitted(model="a", step=s, jobs=[s]) for s in range(1, 8)]
    journal += [ModelRolledBack(model="a", step=4, jobs=6),          # a restart from step 4: 3 steps
                ModelRolledBack(model="b", step=0, jobs=0),          # a new model: nothing
                StepCommitted(model="a", step=5, jobs=[5]),
                MembershipOpened(model="a", version=2, step=5),
                ModelRolledBack(model="a", step=4, jobs=2),          # its group changed: 1 step
                StepCommitted(model="a", step=5, jobs=[5]),
                ModelRolledBack(model="a", step=5, jobs=0, cause="membership")]
    assert rollbacks_from_journal(journal) == {"restart": 3, "membership": 1}
