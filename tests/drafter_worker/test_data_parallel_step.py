"""Two ranks over gloo train exactly what one process accumulating the same micro-batches trains.

Real processes (spawn), a real FileStore rendezvous and gloo collectives, for the linear test model
and for the real DFlash and EAGLE-3 drafters on a tiny target. Each step, rank r trains on its own micro-batches;
the ranks exchange job ids (int64 rows, no pickle), sum gradients and the supervised-position total,
and divide once. After every step both ranks hold identical weights, equal to those of one process
that accumulated all of the step's micro-batches, and report the step's loss over all of them. A
DFlash rank's backend calls of a step (micro-batches, gradient sum, step) read the host once.
"""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch
from safetensors.torch import load_file

from dp_ranks import BACKENDS, NUM_STEPS, WORLD, jobs, make_backend, rank_main, train_on, weights
from eagle3_testing import random_prepared
from hsd_testing import started


@pytest.mark.parametrize("kind", BACKENDS)
def test_two_ranks_match_one_process_accumulating_the_same_micro_batches(kind, request, tmp_path):
    target_dir = str(request.getfixturevalue("tiny_target")) if kind != "linear" else None
    if kind == "eagle3":
        random_prepared(tmp_path / "data")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(kind, rank, str(tmp_path / "store"), str(tmp_path), target_dir))
             for rank in range(WORLD)]
    with started(procs):
        for p in procs:
            p.join(timeout=180)
            assert p.exitcode == 0

    single = make_backend(kind, target_dir, str(tmp_path / "single"))
    initial = weights(make_backend(kind, target_dir, str(tmp_path / "initial")))
    for step in range(NUM_STEPS):
        step_jobs = [j for rank in range(WORLD) for j in jobs(step, rank)]
        for job_id in step_jobs:
            train_on(single, job_id, kind)
        loss = single.apply_step(step_jobs)["loss"]
        expected = weights(single)
        ranks = [load_file(str(tmp_path / f"rank{rank}-step{step}.safetensors")) for rank in range(WORLD)]
        assert ranks[0].keys() == ranks[1].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(ranks[0][name], ranks[1][name]), f"step {step}: {name} differs between ranks"
            torch.testing.assert_close(ranks[0][name], tensor, rtol=1e-5, atol=1e-6)
        for rank in range(WORLD):  # the group's loss over every rank's micro-batches, not a rank's share
            reported = json.loads((tmp_path / f"rank{rank}-step{step}.json").read_text())
            assert reported["loss"] == pytest.approx(loss, rel=1e-6)
            if kind == "dflash":  # a rank's micro-batches, gradient sum and step read the host once
                assert reported["host_reads"] == ["tolist"], reported["host_reads"]
    final = weights(single)
    # (EAGLE-3's d2t/t2d are the vocabulary, not weights: they must stay put.)
    assert all(not torch.equal(final[name], initial[name]) for name in final if final[name].is_floating_point()), \
        "some weights never moved"
