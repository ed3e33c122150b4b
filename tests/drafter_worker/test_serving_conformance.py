"""Serving conformance: a trained drafter's servable directory, in the run and as ``hsd export`` copies
it, loads in vLLM and SGLang as they read it (:mod:`serving_loaders`, written from their loaders),
fed the layers it trained on; and each broken copy fails: an extra weights file, a renamed tensor,
a missing ``target_layer_ids`` / ``mask_token`` / ``draft_vocab_size``, layer ids off by one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from common.run.capture_contract import contract_from_config
from common.dataplane.slots import SlotBatch, SlotHeader
from common.run.witness import latest_checkpoint, servable_dir
from dflash_testing import VOCAB, backend_config, load_target, make_target, random_batch
from drafter_worker.dflash_backend import DFlashBackend
from drafter_worker.eagle3_backend import Eagle3Backend
from drafter_worker.factory import trainer_backend
from eagle3_testing import backend_config as eagle3_config
from eagle3_testing import random_batch as eagle3_batch
from eagle3_testing import random_prepared
from hsd.cli import main as cli_main
from serving_loaders import ENGINES, load_problems
from worker_jobs import held_job

MASK = "<|mask|>"


def _save_tokenizer(target_dir: Path) -> None:
    """A word-level tokenizer over the tiny target's vocabulary whose mask token is its last id."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {MASK: VOCAB - 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0")),
                                        mask_token=MASK, unk_token="w0")
    tokenizer.save_pretrained(target_dir)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("served_target")
    make_target(path)
    _save_tokenizer(path)
    return path


def _train_and_export(backend, config, batches, tmp_path: Path) -> tuple[Path, Path]:
    for job_id, (hs, ids, mask, lens) in enumerate(batches):
        header = SlotHeader(generation=1, job_id=job_id, bucket=0, batch_size=2, seq_len=ids.shape[1],
                            num_tokens=int(lens.sum()))
        backend.micro_batch(held_job(job_id), SlotBatch(hs, ids.to(torch.int32), mask.to(torch.uint8),
                                                        lens.to(torch.int32), header))
    backend.apply_step(list(range(len(batches))))
    backend.save_checkpoint(config.run_dir)
    out = tmp_path / "served"
    assert cli_main(["export", "--run-dir", str(config.run_dir), "--out", str(out)]) == 0
    return servable_dir(latest_checkpoint(config.run_dir, backend.model_id)), out


@pytest.fixture(scope="module")
def dflash_export(target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash")
    config = backend_config(target, tmp / "run")
    model = load_target(target)
    batches = [random_batch(model, batch=2, seq_len=20, seed=s) for s in (1, 2)]
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=8)
    run_model, copy = _train_and_export(backend, config, batches, tmp)
    return run_model, copy, list(contract_from_config(config).layer_ids)


@pytest.fixture(scope="module")
def eagle3_export(target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3")
    config = eagle3_config(target, tmp / "run", random_prepared(tmp / "data"))
    model = load_target(target)
    batches = [eagle3_batch(model, batch=2, seq_len=20, seed=s) for s in (1, 2)]
    backend = trainer_backend(config, "drafter-0", backend_class=Eagle3Backend, schedule_jobs=8)
    run_model, copy = _train_and_export(backend, config, batches, tmp)
    return run_model, copy, list(contract_from_config(config).layer_ids)


def _problems(directory: Path, target: Path, layer_ids: list[int]) -> dict[str, list[str]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return {engine: load_problems(engine, directory, target_dir=target, trained_layer_ids=layer_ids,
                                  tokenizer=tokenizer) for engine in ENGINES}


@pytest.mark.parametrize("objective", ["dflash", "eagle3"])
def test_the_run_model_and_the_export_load_in_both_engines(objective, target, request):
    run_model, copy, layer_ids = request.getfixturevalue(f"{objective}_export")
    for directory in (run_model, copy):
        assert _problems(directory, target, layer_ids) == {"vLLM": [], "SGLang": []}, directory


def _broken(source: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "broken"
    shutil.copytree(source, copy)
    doc = json.loads((copy / "config.json").read_text())
    edit(copy, doc)
    (copy / "config.json").write_text(json.dumps(doc))
    return copy


def _extra_weights(copy: Path, _doc: dict) -> None:
    shutil.copy(copy / "model.safetensors", copy / "optimizer-state.safetensors")


def _rename_tensor(copy: Path, _doc: dict) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(copy / "model.safetensors")
    tensors["fc.weights"] = tensors.pop("fc.weight")
    save_file(tensors, copy / "model.safetensors")


def _drop(section: str | None, key: str):
    def edit(_copy: Path, doc: dict) -> None:
        (doc[section] if section else doc).pop(key)
    return edit


def _shift(section: str | None, key: str, by: int):
    def edit(_copy: Path, doc: dict) -> None:
        place = doc[section] if section else doc
        place[key] = [i + by for i in place[key]]
    return edit


# (broken copy, objective, engines that must refuse it, a phrase of the reason)
BROKEN = [
    ("extra weights file", "dflash", ENGINES, "reads 2 weight files"),
    ("extra weights file", "eagle3", ENGINES, "reads 2 weight files"),
    ("renamed tensor", "dflash", ENGINES, "tensor 'fc.weights' maps to"),
    ("renamed tensor", "eagle3", ENGINES, "tensor 'fc.weights' maps to"),
    ("no target_layer_ids", "dflash", ENGINES, "finds no layer ids"),
    ("no mask_token", "dflash", ("SGLang",), "no dflash_config.mask_token"),
    ("no draft_vocab_size", "eagle3", ENGINES, "no draft_vocab_size"),
    ("layer ids off by one", "dflash", ENGINES, "the drafter trained on the outputs of"),
    ("vLLM layer ids off by one", "eagle3", ("vLLM",), "the drafter trained on the outputs of"),
    ("SGLang layer ids off by one", "eagle3", ("SGLang",), "the drafter trained on the outputs of"),
]
EDITS = {"extra weights file": _extra_weights, "renamed tensor": _rename_tensor,
         "no target_layer_ids": _drop("dflash_config", "target_layer_ids"),
         "no mask_token": _drop("dflash_config", "mask_token"), "no draft_vocab_size": _drop(None, "draft_vocab_size"),
         "layer ids off by one": _shift("dflash_config", "target_layer_ids", 1),
         "vLLM layer ids off by one": _shift(None, "eagle_aux_hidden_state_layer_ids", -1),
         "SGLang layer ids off by one": _shift("eagle_config", "eagle_aux_hidden_state_layer_ids", 1)}


@pytest.mark.parametrize("broken, objective, engines, reason", BROKEN, ids=[f"{o}-{b}" for b, o, _, _ in BROKEN])
def test_a_broken_copy_fails(broken, objective, engines, reason, target, request, tmp_path):
    _, copy, layer_ids = request.getfixturevalue(f"{objective}_export")
    problems = _problems(_broken(copy, tmp_path, EDITS[broken]), target, layer_ids)
    for engine in ENGINES:
        if engine in engines:
            assert any(reason in p for p in problems[engine]), (engine, problems[engine])
        else:
            assert not any(reason in p for p in problems[engine]), (engine, problems[engine])


def test_a_drafter_trained_on_the_last_layer_is_served_by_vllm_and_refused_by_sglang(dflash_export, target, tmp_path):
    """vLLM collects the last layer's output after its layer loop; SGLang captures inside it only."""
    _, copy, _ = dflash_export
    num_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    broken = _broken(copy, tmp_path, lambda _c, doc: doc["dflash_config"].update(target_layer_ids=[1, num_layers - 1]))
    problems = _problems(broken, target, [1, num_layers - 1])
    assert any(f"never collects the top of layer {num_layers}" in p for p in problems["SGLang"]), problems
    assert not any("never collects" in p for p in problems["vLLM"]), problems
