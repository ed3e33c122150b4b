"""``hsd bench dflash`` runs end to end on tiny sizes (structure only; speed is for the command to print)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.dflash_step import spaced_layer_ids
from hsd.cli import main


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # as the drafter tests run it: the timed micro-batches share the cores with others


def test_spaced_layer_ids_follow_the_dflash_rule():
    assert spaced_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert spaced_layer_ids(36, 1) == [18]


def test_bench_dflash_json(capsys):
    assert main(["bench", "dflash", "--seq-lens", "32", "64", "--anchors", "4", "--batch-tokens", "64",
                 "--block-size", "4", "--reps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["seq_len"], r["batch"], r["anchors"]) for r in result["rows"]] == [(32, 2, 4), (64, 1, 4)]
    assert all(r["ms"] > 0 and r["tok_s"] > 0 and r["blocks"] == 4 * r["batch"] for r in result["rows"])
