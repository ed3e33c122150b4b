"""The capture contract: derived from config.json alone, compared across sides, sizing the slots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.run.capture_contract import (CaptureContract, adopt_contract, build_contract, check_same_contract, contract_from_config,
                                     contract_from_model_dir, resolve_capture_dtype)
from common.run.config import ConfigError, load_config
from common.dataplane.slots import SlotLayout
from drafter_worker.dflash.family import default_layer_ids

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


def _model_dir(tmp_path, doc=QWEN3_8B):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(doc))
    return path


def test_default_layers_are_the_dflash_choice():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_layer_ids(8, 3) == [1, 3, 5]
    assert default_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="6 capture layers do not fit between layer 1 and layer 5"):
        default_layer_ids(8, 6)


def test_contract_from_config_json_needs_no_torch(tmp_path):
    contract = contract_from_model_dir(_model_dir(tmp_path), dtype="bfloat16")
    assert contract.to_dict() == {"architecture": "Qwen3ForCausalLM", "num_layers": 36, "hidden_size": 4096,
                                  "layer_ids": [1, 9, 17, 25, 33], "dtype": "bfloat16", "final_norm": False,
                                  "capture_point": "layer_output"}
    assert contract.row_width == 5 * 4096
    assert CaptureContract.from_dict(contract.to_dict()) == contract
    # The dispatcher derives it and imports no model code: the module must not pull torch in.
    probe = "import sys, common.run.capture_contract; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2]).stdout.strip() == "False"


def test_eagle3_contract_takes_three_layers_and_the_final_norm_state():
    contract = build_contract(QWEN3_8B, dtype="bfloat16", objective="eagle3")
    # Layers 1, N/2-1, N-4 of Qwen3-8B: hidden_states indices 2, 18, 33.
    assert (contract.layer_ids, contract.final_norm) == ((1, 17, 32), True)
    assert contract.row_width == 4 * 4096
    assert CaptureContract.from_dict(contract.to_dict()) == contract
    with pytest.raises(ValueError, match="capture_layers"):
        build_contract({**QWEN3_8B, "num_hidden_layers": 4}, dtype="bfloat16", objective="eagle3")
    with pytest.raises(ValueError, match="final_norm"):
        check_same_contract(contract, build_contract(QWEN3_8B, layer_ids=[1, 17, 32], dtype="bfloat16"))


def test_multimodal_config_reads_the_text_model():
    doc = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"num_hidden_layers": 34,
                                                                                "hidden_size": 2560}}
    contract = build_contract(doc, layer_ids=[2, 30], dtype="bfloat16")
    assert (contract.num_layers, contract.hidden_size, contract.layer_ids) == (34, 2560, (2, 30))


def test_differing_contracts_raise_naming_both_sides():
    ours = build_contract(QWEN3_8B, dtype="bfloat16")
    theirs = build_contract(QWEN3_8B, layer_ids=[1, 9, 17, 25, 32], dtype="float32")
    check_same_contract(ours, CaptureContract.from_dict(ours.to_dict()))
    with pytest.raises(ValueError) as info:
        check_same_contract(ours, theirs, ours_name="target-0", theirs_name="drafter-1")
    message = str(info.value)
    assert "between target-0 and drafter-1" in message
    assert "layer_ids: target-0 [1, 9, 17, 25, 33] vs drafter-1 [1, 9, 17, 25, 32]" in message
    assert "dtype: target-0 'bfloat16' vs drafter-1 'float32'" in message


def test_a_contract_from_before_the_capture_point_was_recorded_is_refused():
    """An old run's contract has no capture_point: its last layer was taken after the final norm, so
    it never passes as the current one, and the message says why and what to do."""
    ours = build_contract(QWEN3_8B, dtype="bfloat16")
    old = {key: value for key, value in ours.to_dict().items() if key != "capture_point"}
    assert CaptureContract.from_dict(old).capture_point == "hidden_states"
    with pytest.raises(ValueError, match=r"capture_point: this run 'layer_output' vs target t0 'hidden_states'.*"
                                         r"train it again in a new run directory"):
        adopt_contract(ours, CaptureContract.from_dict(old), theirs_name="target t0")


def test_the_last_layer_is_refused_naming_sglang_the_engine_that_cannot_serve_it(tmp_path):
    """SGLang captures a layer's output as the stream entering the next layer (layers_to_capture =
    ids + 1, inside the layer loop), so it never serves the last layer's output; vLLM collects it after
    the loop. A config naming it is refused, naming SGLang, unless target.allow_unservable is set."""
    model = _model_dir(tmp_path)
    for objective, layers in (("dflash", "[1, 17, 35]"), ("eagle3", "[1, 17, 35]")):
        overrides = [f"target.model={model}", f"target.capture_layers={layers}", f"drafter.objective={objective}"]
        with pytest.raises(ConfigError, match=rf"target.capture_layers \[1, 17, 35\]: SGLang serves layers 0..34 of "
                                              rf"this 36-layer target for {objective}, not \[35\] \(SGLang captures "
                                              rf".*target.allow_unservable=true") as refused:
            load_config(None, overrides)
        assert "vLLM" not in str(refused.value)  # vLLM 0.33 collects the last layer's output after its loop
        assert load_config(None, [*overrides, "target.allow_unservable=true"]).target.capture_layers == [1, 17, 35]
    # The defaults of both objectives are servable.
    assert load_config(None, [f"target.model={model}"]).target.capture_layers == []
    assert load_config(None, [f"target.model={model}", "drafter.objective=eagle3"]).drafter.objective == "eagle3"


@pytest.mark.parametrize("layer_ids, match", [([3, 1], "ascending"), ([1, 36], "outside the target's layers 0..35"),
                                              ([], None)])
def test_contract_checks_its_layers(layer_ids, match):
    if match is None:
        with pytest.raises(ValueError, match="at least one layer"):
            CaptureContract("X", 4, 8, (), "float32")
        return
    with pytest.raises(ValueError, match=match):
        build_contract(QWEN3_8B, layer_ids=layer_ids, dtype="bfloat16")


def test_config_validates_the_model_and_its_layers(tmp_path):
    model = _model_dir(tmp_path)
    config = load_config(None, [f"target.model={model}", "target.capture_layers=[2, 20, 30]", "target.gpus=[0]"])
    assert contract_from_config(config).layer_ids == (2, 20, 30)
    with pytest.raises(ConfigError, match="target.model: .* does not exist"):
        load_config(None, [f"target.model={tmp_path / 'nope'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"target.model: .*\(no config.json\)"):
        load_config(None, [f"target.model={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="target.capture_layers: .* outside the target's layers 0..35"):
        load_config(None, [f"target.model={model}", "target.capture_layers=[1, 40]"])
    with pytest.raises(ConfigError, match="target.capture_layers: expected distinct"):
        load_config(None, ["target.capture_layers=[5, 5]"])
    with pytest.raises(ConfigError, match="target.num_capture_layers: 40 capture layers do not fit"):
        load_config(None, [f"target.model={model}", "target.num_capture_layers=40"])
    with pytest.raises(ConfigError, match="target.attn_implementation"):
        load_config(None, [f"target.model={model}", "target.attn_implementation=fast"])


def test_dtype_auto_is_resolved_from_the_config_alone(tmp_path):
    model = _model_dir(tmp_path)
    assert resolve_capture_dtype(load_config(None, [f"target.model={model}"])) == "float32"  # a model on the CPU
    assert resolve_capture_dtype(load_config(None, [f"target.model={model}", "target.gpus=[0]"])) == "bfloat16"
    assert resolve_capture_dtype(load_config(None, [])) == "bfloat16"  # sim targets keep their layout
    assert resolve_capture_dtype(load_config(None, [f"target.model={model}", "target.dtype=float16"])) == "float16"


def test_slot_layout_comes_from_the_model(tmp_path):
    model = _model_dir(tmp_path)
    config = load_config(None, [f"target.model={model}", "target.gpus=[0]", "schedule.buckets=[512, 4096]",
                                "schedule.tokens_per_batch=16384", "target.hidden_size=64"])
    layout = SlotLayout.from_config(config)
    assert layout == SlotLayout(tokens_per_batch=16384, num_layers=5, hidden_size=4096, dtype="bfloat16", max_seqs=32)
    assert layout == SlotLayout.from_contract(contract_from_config(config), config.schedule)
    # Sim targets keep the hand-set keys, the model notwithstanding.
    sim = load_config(None, [f"target.model={model}", "target.sim=true", "target.hidden_size=64"])
    assert SlotLayout.from_config(sim).hidden_size == 64


def test_one_default_layer_is_the_middle_one_an_engine_serves():
    assert [default_layer_ids(n, 1) for n in (2, 3, 4, 36)] == [[0], [1], [2], [18]]
