"""The live view's derived figures over hand-made snapshots: bottleneck, ETA, pool bytes."""

from __future__ import annotations

import copy

from common.wire.stats_snapshot import AuthView, EpochView, RankView, Snapshot, TransportView, WaitingFor, WorkerView
from core_harness import make_core, register
from common.wire.stats_figures import format_q_hsb, pool_usage
from dispatcher.snapshot import build_snapshot
from ops.stats_view import (CommitRate, WAIT_THRESHOLD, bottleneck_line, dispatcher_line, eta_line, format_stats,
                            name_bottleneck, remaining_jobs, stage_waits)


def worker(wid: str, role: str, *, alive_s: float, wait_s: float, state: str = "busy") -> WorkerView:
    return WorkerView(id=wid, name=f"{role}-{wid}", role=role, pid=1, host="h", gpu=None, state=state, jobs=3,
                      tokens_per_s=1000.0, idle_ratio=round(wait_s / alive_s, 3), heartbeat_age_s=0.1, held=[],
                      alive_s=alive_s, wait_s=wait_s)


def snapshot(*, t: float = 100.0, target_wait: float = 0.0, drafter_wait: float = 0.0, pending: int = 10,
             committed: tuple[int, ...] = (20,), jobs: tuple[int, ...] = (100,), epochs_total: int = 2,
             done: bool = False) -> Snapshot:
    """Two targets and one drafter, each alive ``t`` seconds, waiting the given share of it."""
    return Snapshot(run_dir="runs/x", run_id="r", pid=42, time=1000.0 + t, uptime_s=t, done=done,
                    epochs_total=epochs_total,
                    epochs=[EpochView(epoch=i, jobs=n, committed=c, taken=c, schedule_prefix_deviation=1.0,
                                      consumed_prefix_deviation=1.5) for i, (n, c) in enumerate(zip(jobs, committed))],
                    jobs_by_state={"pending": pending, "extracting": 2, "ready": 3, "training": 1, "consumed": 0,
                                   "committed": sum(committed)},
                    q_hsb={"0": 1, "5": 2}, pool={"free": 10, "writing": 2, "ready": 3, "reading": 1},
                    pool_peak_slots=6,
                    transport=TransportView(kind="shm", slot_bytes=2**20, num_slots=16, pool_bytes=16 * 2**20,
                                            per_target=False),
                    workers=[worker("1", "target", alive_s=t, wait_s=target_wait * t),
                             worker("2", "target", alive_s=t, wait_s=target_wait * t),
                             worker("3", "drafter", alive_s=t, wait_s=drafter_wait * t)],
                    steps=5, models={}, groups={}, given_back={}, errors={}, requests={}, waiters=0,
                    auth=AuthView(mechanism="none"), nodes={})


def test_drafters_starving_names_the_targets():
    line = name_bottleneck(target_wait=0.02, drafter_wait=0.38)
    assert line == ("drafters wait for data 38% — targets are the bottleneck: add targets or raise "
                    "pool.target_credits")


def test_targets_blocked_names_the_drafters():
    assert name_bottleneck(target_wait=0.40, drafter_wait=0.01) == (
        "targets blocked on a full pool 40% — drafters are the bottleneck: add drafters")


def test_balanced_below_the_threshold():
    below = WAIT_THRESHOLD - 0.01
    assert name_bottleneck(target_wait=below, drafter_wait=below).startswith("balanced: targets wait 14%")


def test_both_waiting_points_at_the_pool():
    assert "the pool holds both back: raise pool.slots" in name_bottleneck(target_wait=0.3, drafter_wait=0.3)


def test_tail_and_done_and_missing_stage_are_not_blamed_on_a_stage():
    assert name_bottleneck(target_wait=0.9, drafter_wait=0.5, tail=True).startswith("epoch tail: nothing left")
    assert name_bottleneck(target_wait=0.9, drafter_wait=0.9, done=True) == "run complete"
    assert name_bottleneck(target_wait=0.1, drafter_wait=None).startswith("no drafter registered")


def test_stage_waits_since_start_and_over_the_last_interval():
    early = snapshot(t=100.0, target_wait=0.0, drafter_wait=0.5)
    assert stage_waits(early) == {"target": 0.0, "drafter": 0.5}
    # in the last 100 s the drafter waited 90 s: the recent share, not the average since the start
    later = copy.deepcopy(early)
    later.time += 100
    for w in later.workers:
        w.alive_s += 100
    later.workers[2].wait_s += 90
    assert stage_waits(later, early)["drafter"] == 0.9
    assert abs(stage_waits(later)["drafter"] - 0.7) < 1e-9
    # a snapshot from another dispatcher (restart) is not a baseline
    other = copy.deepcopy(early)
    other.pid = 7
    assert abs(stage_waits(later, other)["drafter"] - 0.7) < 1e-9


def test_bottleneck_line_reads_the_snapshot():
    assert "targets are the bottleneck" in bottleneck_line(snapshot(drafter_wait=0.38))
    assert "drafters are the bottleneck" in bottleneck_line(snapshot(target_wait=0.4))
    # the last epoch started and nothing is pending: idle targets are the tail, not a drafter shortage
    tail = snapshot(target_wait=0.4, pending=0, committed=(100, 80), jobs=(100, 100))
    assert "epoch tail" in bottleneck_line(tail)
    # nothing pending but an epoch still to start: targets that wait are still blocked
    assert "drafters are the bottleneck" in bottleneck_line(snapshot(target_wait=0.4, pending=0))


def test_eta_from_the_commit_rate():
    assert remaining_jobs(snapshot(committed=(20,), jobs=(100,), epochs_total=2)) == (80, 180)
    assert remaining_jobs(snapshot(committed=(100, 30), jobs=(100, 90), epochs_total=3)) == (60, 150)
    rate = CommitRate()
    first = snapshot(t=10.0, committed=(20,))
    rate.add(first)
    assert rate.rate(first) == 2.0  # one snapshot: 20 jobs in 10 s since the start
    second = snapshot(t=20.0, committed=(60,))
    rate.add(second)
    assert rate.rate(second) == 4.0  # 40 jobs in the last 10 s
    assert eta_line(second, 4.0) == ("eta       epoch in 10s, run in 35s (4.0 jobs/s committed; "
                                     "40 left in this epoch, 140 in the run)")
    assert "unknown" in eta_line(snapshot(committed=(0,)), 0.0)
    assert eta_line(snapshot(done=True), 1.0) == "eta       run complete"


def test_pool_usage_and_the_printed_view():
    s = snapshot(drafter_wait=0.38)
    assert pool_usage(s) == (6 * 2**20, 16 * 2**20)
    text = format_stats(s)
    assert "pool use  6.0 MiB of 16.0 MiB (38%)" in text
    assert "eta       epoch in" in text
    assert "bottleneck drafters wait for data 38% — targets are the bottleneck" in text
    assert "steps     5   given back" in text  # no step mix before a step committed here
    s.step_mix = 0.875
    assert "steps     5 (mixed 88% since the dispatcher started)   given back" in format_stats(s)


def test_a_tensor_parallel_target_is_one_row_with_its_ranks():
    s = snapshot()
    s.workers[0].tp_ranks = [RankView(rank=0, pid=4100, gpu=0), RankView(rank=1, pid=4123, gpu=1)]
    lines = format_stats(s).splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("target-1 "))
    assert lines[row + 1].split() == ["tensor-parallel,", "2", "ranks:", "0:pid", "4100", "gpu", "0", "1:pid", "4123",
                                      "gpu", "1"]
    assert sum(line.startswith("target-") for line in lines) == 2  # the two targets, the group one of them


def test_q_hsb_lists_every_bucket_empty_ones_as_zero(tmp_path):
    # a real core with one job ready: the snapshot, the printed view and the progress line name all buckets
    core = make_core(tmp_path, epochs=1, min_ready=1)
    (t,) = register(core, "target", 1)
    grant = core.get_job(t, 1.0)
    core.job_ready(t, grant.job.job_id, grant.job.generation, 0.0, 1.0)
    q_hsb = build_snapshot(core, 1.0).q_hsb
    assert list(q_hsb) == ["0", "1", "2"] and sum(q_hsb.values()) == 1
    assert q_hsb[str(grant.job.bucket)] == 1
    empty = next(b for b, n in q_hsb.items() if n == 0)
    assert f"b{empty}:0" in format_q_hsb(q_hsb)
    s = snapshot()
    s.q_hsb = q_hsb
    assert "q_hsb     " + format_q_hsb(q_hsb) in format_stats(s).splitlines()
    assert format_q_hsb(core.pool.ready_per_bucket()) == format_q_hsb(q_hsb)  # the progress line's figures


def test_samples_too_long_for_the_schedule_are_shown_and_survive_the_wire():
    import msgspec
    from common.wire.stats_snapshot import DroppedSamples
    s = snapshot()
    assert "dropped" not in format_stats(s) and "dropped_samples" not in msgspec.json.encode(s).decode()
    s.dropped_samples = DroppedSamples(count=7, first=[3, 9, 11, 12, 40], longer_than=256)
    assert ("dropped   7 sample(s) longer than the last bucket (256), in no epoch: sample 3, 9, 11, 12, 40, ..."
            in format_stats(s).splitlines())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Snapshot).dropped_samples == s.dropped_samples


def test_the_dispatcher_line_says_how_much_of_a_core_its_loop_takes_and_on_what():
    early = snapshot(t=100.0)
    assert dispatcher_line(early) is None  # a dispatcher that sends no loop figures: no line
    early.loop_cpu_s = {"get_hs": 10.0, "get_job": 8.0, "poll": 2.0}
    assert dispatcher_line(early) == "dispatcher loop 20% of a core: get_hs 10%, get_job 8%, poll 2%"
    assert "dispatcher loop 20% of a core" in format_stats(early)
    # over the last 10 s the loop was busy 9 s of them: the recent share, and the warning
    later = copy.deepcopy(early)
    later.uptime_s += 10
    later.loop_cpu_s = {"get_hs": 15.0, "get_job": 12.0, "poll": 2.5, "heartbeat": 0.5}
    line = dispatcher_line(later, early)
    assert line.startswith("dispatcher loop 100% of a core: get_hs 50%, get_job 40%, heartbeat 5%, poll 5%")  # ties by name
    assert "near one core" in line
    # and how often it woke: a loop that wakes for every request pays most for each
    later.loop_wakeups, later.requests = 5_000, {**early.requests, "get_hs": early.requests.get("get_hs", 0) + 12_000}
    early.loop_wakeups = 1_000
    assert dispatcher_line(later, early).startswith(
        "dispatcher loop 100% of a core, 400 wake-ups/s (3.0 requests each): get_hs 50%")
    # a snapshot of another dispatcher (it restarted) is no baseline: since this one started
    other = copy.deepcopy(early)
    other.pid = 7
    assert dispatcher_line(later, other).startswith("dispatcher loop 27% of a core")


def test_a_run_of_thousands_of_workers_shows_a_summary_and_the_workers_that_most_need_a_look():
    """2,000 workers would be 2,000 rows: past --rows the table says each role's states and shows the
    workers silent longest, then the most idle; --rows 0 shows every one."""
    s = snapshot()
    s.workers = [worker(str(i), "target" if i % 3 else "drafter", alive_s=100.0, wait_s=(i % 50) / 10)
                 for i in range(2000)]
    s.workers[700].heartbeat_age_s, s.workers[900].heartbeat_age_s = 9.0, 30.0  # silent
    s.workers[1200].state = "starved"
    s.workers[1300].metrics = {"loss": 1.5}
    s.waiting_for = WaitingFor(epochs={}, models={}, workers=[w.name for w in s.workers[:40]], reasons=["epoch 1: x"])
    lines = format_stats(s, rows=10).splitlines()
    rows = [line for line in lines if line.split() and line.split()[0].startswith(("target-", "drafter-"))
            and len(line.split()) > 6]
    assert len(rows) == 10
    assert rows[0].startswith("drafter-900 ") and rows[1].startswith("target-700 ")  # silent longest first
    assert all(line.split()[6] == "4.9%" for line in rows[2:])  # then the most idle
    mean = {role: sum(w.idle_ratio for w in s.workers if w.role == role) / n for role, n in (("target", 1333), ("drafter", 667))}
    assert f"targets      1,333: busy 1,333; 1,333,000 tok/s, idle {mean['target']:.1%} mean, heartbeat age max 9.0s" in lines
    assert f"drafters     667: busy 666  starved 1; 667,000 tok/s, idle {mean['drafter']:.1%} mean, heartbeat age max 30.0s" in lines
    assert any("1,990 more not shown (--rows 0 shows every one)" in line for line in lines)
    assert not any("last step" in line for line in lines)  # target-1300 is not among the ten shown
    on = next(line for line in lines if line.lstrip().startswith("on "))
    assert on.count(",") == 11 and on.endswith("and 28 more")
    every = format_stats(s, rows=0).splitlines()
    assert sum(1 for line in every if line.startswith(("target-", "drafter-")) and "last step" not in line) == 2000
    assert not any("more not shown" in line for line in every) and "target-1300  last step: loss 1.5" in every
    small = snapshot()
    assert not any("need a look" in line for line in format_stats(small, rows=3).splitlines())  # 3 workers fit
