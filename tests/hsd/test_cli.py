"""The `hsd` command line: clear errors for bad input, the schedule printout, a failing run's exit code."""

from __future__ import annotations

import json
import random

from hsd_testing import hsd


def issue_lengths(path, seed=1):
    """~6,000 samples over buckets [256..8192] with sample shares 4/7/10/15/17/47 %."""
    rng = random.Random(seed)
    bounds = [0, 256, 512, 1024, 2048, 4096, 8192]
    lengths = []
    for share, lo, hi in zip([4, 7, 10, 15, 17, 47], bounds, bounds[1:]):
        lengths += [rng.randint(lo + 1, hi) for _ in range(share * 60)]
    lengths += [9000, 12000]  # longer than the last bucket: dropped and counted
    rng.shuffle(lengths)
    path.write_text("\n".join(map(str, lengths)) + "\n")
    return path


SCHEDULE = ["schedule.buckets=[256,512,1024,2048,4096,8192]", "schedule.tokens_per_batch=16384"]


def schedule_json(lengths, *extra):
    return json.loads(hsd("schedule", "--lengths", str(lengths), "--json", *SCHEDULE, *extra).stdout)


def test_schedule_json_is_fair_repeatable_and_epoch_dependent(tmp_path):
    lengths = issue_lengths(tmp_path / "lengths.txt")
    first = schedule_json(lengths)
    assert [b["max_len"] for b in first["buckets"]] == [256, 512, 1024, 2048, 4096, 8192]
    assert set(first["buckets"][0]) >= {"id", "max_len", "batch_size", "num_batches", "num_samples"}
    assert first["num_dropped"] == 2
    assert len(first["order"]) == sum(b["num_batches"] for b in first["buckets"])
    assert first["prefix_deviation"] <= 2 and first["tail_skew"] <= 0.05
    assert 0.9 < first["padded_fill"] <= 1.0 and 0.0 < first["pairs_batched_again"] < 1.0  # sorted: members move
    assert schedule_json(lengths)["order"] == first["order"]
    assert schedule_json(lengths, "--epoch", "1")["order"] != first["order"]
    shuffled = schedule_json(lengths, "schedule.order=shuffle")
    assert shuffled["prefix_deviation"] > first["prefix_deviation"]


def test_schedule_text_shows_both_orders(tmp_path):
    out = hsd("schedule", "--lengths", str(issue_lengths(tmp_path / "l.txt")), *SCHEDULE).stdout
    assert "interleave" in out and "shuffle" in out and "prefix deviation" in out and "2 dropped" in out
    assert "padded tokens" in out and "together again in epoch 1" in out


def test_bad_input_is_a_clear_error(tmp_path):
    cases = [
        (["launch", "--config", str(tmp_path / "missing.yaml")], "does not exist"),
        (["launch", "pool.sloths=3"], "pool.sloths"),
        (["launch", "run.epochs=many"], "run.epochs"),
        (["schedule", "--lengths", str(tmp_path / "nope.txt")], "nope.txt"),
        (["target", "run.dir=" + str(tmp_path / "r")], "target.model"),
        (["drafter", "run.dir=" + str(tmp_path / "r")], "target.model"),
        (["dispatcher", "run.dir=" + str(tmp_path / "big"), "pool.slots=100000000"], "does not fit"),
    ]
    (tmp_path / "bad.txt").write_text("12\nabc\n")
    cases.append((["schedule", "--lengths", str(tmp_path / "bad.txt")], "bad.txt:2"))
    for args, needle in cases:
        proc = hsd(*args, check=False, timeout=60)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_launch_fails_when_no_drafter_can_run(tmp_path):
    run_dir = tmp_path / "run"
    # drafter.sim=false asks for the real DFlash drafter, which needs target.model: every drafter exits 2.
    proc = hsd("launch", f"run.dir={run_dir}", "target.sim=true", "drafter.sim=false", "drafter.max_restarts=1",
               "data.synthetic_samples=100", check=False, timeout=120)
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert "restart 1/1" in output and "no drafter is left" in output
