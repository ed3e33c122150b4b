"""A drafter family defined outside the package (:mod:`toy_family`, in tests/) trains end to end.

`hsd launch` on sim targets with ``drafter.objective=toy``: the family reaches every process through
``HSD_DRAFTER_FAMILIES``; its own config section is read, written into the resolved config and
handed to its backend; its checkpoints' exports load as its proposer through the registry.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
import yaml

from common.run.capture_contract import build_contract
from common.run.config import ConfigError, load_config
from common.run import drafter_family
from common.run.drafter_family import ENV, family_of, load_families
from common.run.witness import latest_checkpoint
from drafter_worker.speculative_eval import as_proposer, load_proposer
from hsd_testing import assert_exactly_once, kill_tree, report, start_hsd

TESTS = Path(__file__).resolve().parents[1]
MODULE = "toy_family"


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for this test only: left in the table, it would put its section into
    every config this test process writes afterwards, which a process started without
    HSD_DRAFTER_FAMILIES refuses (another test's bench, run next by the same worker)."""
    load_families([MODULE])
    family = importlib.import_module(MODULE).FAMILY  # registered at its first import only
    drafter_family._FAMILIES.pop(family.objective, None)
    monkeypatch.setitem(drafter_family._FAMILIES, family.objective, family)  # gone again after the test
    monkeypatch.setenv(ENV, MODULE)  # the launched processes import it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return family_of("toy")


def test_a_family_from_outside_the_package_trains_end_to_end_on_sim_targets(toy, run_dir, tmp_path):
    args = [f"run.dir={run_dir}", "target.sim=true", "target.hidden_size=16", "target.num_capture_layers=2",
            "drafter.objective=toy", "toy.lr=0.02", "toy.num_drafts=3", "drafter.accum_steps=2",
            "drafter.checkpoint_every=2", "data.synthetic_samples=48", "run.epochs=1", "dispatcher.heartbeat_s=0.2"]
    launch = start_hsd("launch", *args, log_path=tmp_path / "launch.log")
    try:
        assert launch.wait(timeout=300) == 0, (tmp_path / "launch.log").read_text()[-4000:]
    finally:
        kill_tree(launch)
    assert_exactly_once(report(run_dir))
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["toy"] == {"lr": 0.02, "num_drafts": 3} and resolved["drafter"]["objective"] == "toy"
    # the export of the last checkpoint is the toy's, and drafts as its proposer
    proposer = load_proposer(latest_checkpoint(run_dir, "drafter-0").path, None)
    assert type(proposer).__name__ == "ToyProposer" and proposer.block_size == 4
    assert proposer.propose(torch.tensor([5, 7]), None).tolist() == [7, 7, 7]
    assert as_proposer(proposer.model, None).block_size == 4  # a model of the family: its proposer


def test_the_family_sets_its_section_and_default_capture_layers(toy):
    config = load_config(None, ["drafter.objective=toy", "toy.num_drafts=5"])
    assert config.toy.num_drafts == 5 and config.toy is config.family_sections["toy"]
    with pytest.raises(ConfigError, match="toy.lr must be positive"):
        load_config(None, ["drafter.objective=toy", "toy.lr=0"])
    doc = {"architectures": ["X"], "num_hidden_layers": 8, "hidden_size": 16}
    contract = build_contract(doc, dtype="float32", objective="toy")
    assert contract.layer_ids == (6,) and not contract.final_norm
    with pytest.raises(ConfigError, match="no drafter family 'nosuch'"):
        load_config(None, ["drafter.objective=nosuch"])
