"""Export: the published checkpoint layout, and a reload that gives the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_testing import LAYER_IDS, make_trainer, random_batch
from drafter_worker.dflash.export import load_drafter, save_drafter

EXPECTED_PER_LAYER = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


@pytest.fixture(scope="module")
def trained(tiny_target, tiny_target_model):
    trainer = make_trainer(tiny_target, num_draft_layers=2, lr=3e-3)
    batch = random_batch(tiny_target_model, batch=2, seq_len=20, seed=1)
    for _ in range(3):
        trainer.micro_batch(*batch)
        trainer.apply_step()
    return trainer, batch


def test_export_layout_and_config(trained, tmp_path):
    trainer, _ = trained
    out = save_drafter(trainer.model, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 4
    assert config["num_target_layers"] == 4
    assert config["num_hidden_layers"] == 2
    assert config["dflash_config"]["target_layer_ids"] == LAYER_IDS
    assert config["dflash_config"]["mask_token_id"] == trainer.model_config.mask_token_id
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "vocab_size"):
        assert config[key] == getattr(trainer.model_config.target, key), key
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in EXPECTED_PER_LAYER}
    assert names == expected  # no embedding, no LM head: they are the target's


def test_reload_gives_identical_logits(trained, tiny_target, tmp_path):
    trainer, (hs, ids, _, _) = trained
    out = save_drafter(trainer.model, tmp_path / "drafter", dtype="float32")
    reloaded = load_drafter(out, tiny_target)
    anchors = torch.tensor([[3, 8, 12], [5, 6, 9]])
    model = trainer.model.eval()
    with torch.no_grad():
        expected = model.logits(model(hs, ids, anchors))
        got = reloaded.logits(reloaded(hs, ids, anchors))
    assert torch.equal(got, expected)
    assert reloaded.config.gamma == trainer.model_config.gamma


def test_bfloat16_export_reloads_close(trained, tiny_target, tmp_path):
    trainer, (hs, ids, _, _) = trained
    reloaded = load_drafter(save_drafter(trainer.model, tmp_path / "bf16"), tiny_target)
    anchors = torch.tensor([[3, 8], [5, 9]])
    with torch.no_grad():
        expected = trainer.model(hs, ids, anchors)
        got = reloaded(hs, ids, anchors)
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)


def test_loading_a_non_dflash_directory_fails_clearly(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        load_drafter(tiny_target, tiny_target)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(tmp_path, tiny_target)
