"""``hsd export``: which checkpoint it copies, and the clear errors for what is not there."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.run.servable import ExportError, export_servable, find_checkpoint, weights_files
from common.run.witness import TrainedJobs, save_checkpoint, servable_dir
from hsd.cli import main as cli_main


def _checkpoint(run_dir, model: str, step: int, *, servable: bool = True):
    def write_servable(directory):
        (directory / "config.json").write_text(json.dumps({"step": step}))
        save_file({"w": torch.full((2,), float(step))}, str(directory / "model.safetensors"))

    def write_training(directory):
        save_file({"t0": torch.zeros(3)}, str(directory / "state.safetensors"))
    return save_checkpoint(run_dir, model, step, TrainedJobs(range(step)), keep_last=2,
                           write_servable=write_servable if servable else None, write_training=write_training)


def test_export_copies_the_latest_or_the_named_step(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path / "run", "m", step)
    latest = export_servable(find_checkpoint(tmp_path / "run"), tmp_path / "out")
    assert load_file(latest / "model.safetensors")["w"].tolist() == [6.0, 6.0]
    assert weights_files(latest) == [latest / "model.safetensors"]  # the training state stayed behind
    older = export_servable(find_checkpoint(tmp_path / "run", model="m", step=4), tmp_path / "out4")
    assert json.loads((older / "config.json").read_text()) == {"step": 4}
    assert not list(tmp_path.glob(".out*"))  # no temporary directory left


def test_export_errors_name_what_is_missing(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(ExportError, match="does not exist"):
        find_checkpoint(run)
    run.mkdir()
    with pytest.raises(ExportError, match="holds no checkpoint"):
        find_checkpoint(run)
    _checkpoint(run, "a", 2)
    _checkpoint(run, "b", 3, servable=False)
    with pytest.raises(ExportError, match="2 models .*--model"):
        find_checkpoint(run)
    with pytest.raises(ExportError, match="model 'c' has no checkpoint"):
        find_checkpoint(run, model="c")
    with pytest.raises(ExportError, match=r"no checkpoint at step 5 \(kept: 2\)"):
        find_checkpoint(run, model="a", step=5)
    with pytest.raises(ExportError, match="no servable model"):
        export_servable(find_checkpoint(run, model="b"), tmp_path / "out")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["export", "--run-dir", str(run), "--model", "a", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert cli_main(["export", "--run-dir", str(run), "--model", "a", "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "model a at step 2 exported to" in capsys.readouterr().out


def test_export_refuses_a_servable_part_with_two_weight_files(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run", "m", 1)
    save_file({"x": torch.zeros(1)}, str(servable_dir(checkpoint) / "extra.safetensors"))
    with pytest.raises(ExportError, match="2 \\*.safetensors files"):
        export_servable(checkpoint, tmp_path / "out")


def test_a_dflash_mask_token_without_text_is_refused_at_export(tmp_path, capsys):
    """SGLang finds the mask id by its text (default '<|MASK|>' when dflash_config.mask_token is absent):
    an export whose trained id has no text would be served with another token, so it is refused."""
    checkpoint = _checkpoint(tmp_path / "run", "m", 1)
    config = servable_dir(checkpoint) / "config.json"
    config.write_text(json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 151935}}))
    with pytest.raises(ExportError, match=r"config.json: the drafter trained with mask token id 151935, which has no "
                                          r"text in the target's tokenizer.*'<\|MASK\|>'.*dflash.mask_token_id"):
        export_servable(checkpoint, tmp_path / "out")
    assert cli_main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert "no text in the target's tokenizer" in capsys.readouterr().err and not (tmp_path / "out").exists()
    config.write_text(json.dumps({"dflash_config": {"mask_token_id": 151935, "mask_token": "<|reserved_0|>"}}))
    assert json.loads((export_servable(checkpoint, tmp_path / "out") / "config.json").read_text())[
        "dflash_config"]["mask_token"] == "<|reserved_0|>"
