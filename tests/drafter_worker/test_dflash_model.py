"""The draft model against a hand-written reference, and numeric checks that would catch a wrong mask."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from dflash_testing import LAYER_IDS, VOCAB
from drafter_worker.dflash.config import DFlashConfig
from drafter_worker.dflash.model import build_drafter
from drafter_worker.layers import load_target_head


def _drafter(target_dir, *, block_size=4, num_layers=1, seed=0):
    config = DFlashConfig.from_target(target_dir, layer_ids=LAYER_IDS, block_size=block_size,
                                      num_draft_layers=num_layers, gamma=2.0)
    model = build_drafter(config, target_dir)
    model.init_weights(seed)
    with torch.no_grad():  # norms away from 1 so that a skipped norm shows
        for name, p in model.draft_named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model.eval()


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _cos_sin(positions, head_dim, theta):
    freqs = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    angles = torch.tensor([[p * f for f in freqs] for p in positions], dtype=torch.float32)
    angles = torch.cat([angles, angles], -1)
    return angles.cos()[None], angles.sin()[None]


def _reference_one_block(model, hs_SD, ids_S, anchor):
    """One layer, one block, written out: only ctx[:anchor] is handed to the attention at all."""
    c, dims = model.config, model.config.target
    layer = model.layers[0]
    attn = layer.self_attn
    eps, B, d = dims.rms_norm_eps, c.block_size, dims.head_dim
    ctx = _rms(hs_SD[:anchor] @ model.fc.weight.T, model.hidden_norm.weight, eps)          # [a, H]
    tokens = torch.tensor([int(ids_S[anchor])] + [c.mask_token_id] * (B - 1))
    x = model.embed_tokens.weight[tokens]                                                    # [B, H]
    h = _rms(x, layer.input_layernorm.weight, eps)
    q = (h @ attn.q_proj.weight.T).view(B, dims.num_attention_heads, d)
    k = torch.cat([ctx @ attn.k_proj.weight.T, h @ attn.k_proj.weight.T]).view(anchor + B, dims.num_key_value_heads, d)
    v = torch.cat([ctx @ attn.v_proj.weight.T, h @ attn.v_proj.weight.T]).view(anchor + B, dims.num_key_value_heads, d)
    q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    cos_q, sin_q = _cos_sin(range(anchor, anchor + B), d, dims.rope_theta)
    cos_k, sin_k = _cos_sin(list(range(anchor)) + list(range(anchor, anchor + B)), d, dims.rope_theta)
    q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos_q, sin_q)
    _, k = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_k, sin_k)
    groups = dims.num_attention_heads // dims.num_key_value_heads
    k = k[0].repeat_interleave(groups, 0)
    v = v.transpose(0, 1).repeat_interleave(groups, 0)
    scores = q[0] @ k.transpose(-1, -2) / math.sqrt(d)                                       # no mask at all
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(B, -1) @ attn.o_proj.weight.T
    x = x + out
    h = _rms(x, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    x = x + (torch.nn.functional.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(x, model.norm.weight, eps)


def test_forward_matches_a_hand_written_reference(tiny_target, tiny_target_model):
    from dflash_testing import random_batch
    model = _drafter(tiny_target)
    hs, ids, _, _ = random_batch(tiny_target_model, batch=1, seq_len=16, seed=1)
    anchor = 9
    with torch.no_grad():
        got = model(hs, ids, torch.tensor([[anchor]]))[0, 0]
        expected = _reference_one_block(model, hs[0], ids[0], anchor)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_keys_include_context_before_the_anchor_only(tiny_target, tiny_target_model):
    from dflash_testing import random_batch
    model = _drafter(tiny_target)
    hs, ids, _, _ = random_batch(tiny_target_model, batch=1, seq_len=16, seed=2)
    anchor = torch.tensor([[8]])
    with torch.no_grad():
        base = model(hs, ids, anchor)
        after = hs.clone()
        after[:, 8:] += 5.0   # the anchor's own state and everything after it: invisible
        assert torch.equal(model(after, ids, anchor), base)
        before = hs.clone()
        before[:, 7] += 5.0   # the last context position: injected into the keys and values
        assert (model(before, ids, anchor) - base).abs().max() > 1e-3


def test_blocks_never_see_each_other(tiny_target, tiny_target_model):
    from dflash_testing import random_batch
    model = _drafter(tiny_target, num_layers=2)
    hs, ids, _, _ = random_batch(tiny_target_model, batch=1, seq_len=20, seed=4)
    with torch.no_grad():
        together = model(hs, ids, torch.tensor([[3, 11, 16]]))
        for j, a in enumerate((3, 11, 16)):
            alone = model(hs, ids, torch.tensor([[a]]))
            torch.testing.assert_close(together[:, j], alone[:, 0], atol=1e-5, rtol=1e-5)


def test_flex_attention_path_matches_sdpa(tiny_target, tiny_target_model):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from dflash_testing import random_batch
    model = _drafter(tiny_target, num_layers=2)
    hs, ids, _, _ = random_batch(tiny_target_model, batch=2, seq_len=16, seed=5)
    anchors = torch.tensor([[2, 7, 12], [5, 9, -1]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex attention warns that it is unfused
        dense = model(hs, ids, anchors)
        model.attention = "flex"
        flex = model(hs, ids, anchors)
    torch.testing.assert_close(flex[0], dense[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex[1, :2], dense[1, :2], atol=1e-5, rtol=1e-5)  # the padded block is garbage


def test_shared_head_is_read_from_the_target_and_tied_targets_work(tiny_target, tiny_tied_target, tiny_target_model):
    embed, head = load_target_head(tiny_target)
    torch.testing.assert_close(embed, tiny_target_model.model.embed_tokens.weight)
    torch.testing.assert_close(head, tiny_target_model.lm_head.weight)
    tied_embed, tied_head = load_target_head(tiny_tied_target)
    assert tied_head is tied_embed
    model = _drafter(tiny_tied_target)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not model.lm_head.weight.requires_grad
    names = {n for n, _ in model.draft_named_parameters()}
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert model.config.target.vocab_size == VOCAB and model.config.mask_token_id == VOCAB - 1


def test_a_zero_mask_embedding_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash_testing import make_target
    make_target(tmp_path, seed=2)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.embed_tokens.weight"][VOCAB - 1] = 0
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = DFlashConfig.from_target(tmp_path, layer_ids=LAYER_IDS, block_size=4, num_draft_layers=1, gamma=2.0)
    with pytest.raises(ValueError, match="all zeros"):
        build_drafter(config, tmp_path)
    build_drafter(DFlashConfig.from_target(tmp_path, layer_ids=LAYER_IDS, block_size=4, num_draft_layers=1,
                                           gamma=2.0, mask_token_id=7), tmp_path)


def test_block_sparse_attention_equals_dense_masked_sdpa_with_gradients():
    """The CPU path (context and own block apart, combined by log-sum-exp) against one SDPA call over
    every key under the dense mask: outputs and the gradients of queries, keys and values. Anchor 0
    (no context at all) and a padded anchor are among the blocks."""
    from drafter_worker.dflash.attention import DraftAttention
    from drafter_worker.dflash.mask import dense_block_mask
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, ctx_len, block = 2, 4, 2, 8, 12, 3
    anchors = torch.tensor([[0, 4, 9, 10], [2, 3, 7, -1]])
    num_q = anchors.shape[1] * block
    q = torch.randn(batch, heads, num_q, dim, generator=g, requires_grad=True)
    k_ctx, v_ctx = (torch.randn(batch, kv_heads, ctx_len, dim, generator=g, requires_grad=True) for _ in range(2))
    k_blk, v_blk = (torch.randn(batch, kv_heads, num_q, dim, generator=g, requires_grad=True) for _ in range(2))
    inputs = (q, k_ctx, v_ctx, k_blk, v_blk)
    grad_out = torch.randn(batch, heads, num_q, dim, generator=g)

    got = DraftAttention(anchors, ctx_len=ctx_len, block_size=block, kind="split")(*inputs)
    got_grads = torch.autograd.grad(got, inputs, grad_out)
    k = torch.cat([k_ctx, k_blk], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    v = torch.cat([v_ctx, v_blk], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    mask = dense_block_mask(anchors, ctx_len=ctx_len, block_size=block)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    for name, a, b in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0}])
def test_rope_scaling_equals_the_transformers_frequencies(scaling):
    """The drafters take the target's RoPE scaling (Llama 3.1 style targets): the frequencies equal
    transformers' own for the same config (modelling_rope_utils' init functions, as the target runs)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from common.run.target_config import rope_scaling_of
    from drafter_worker.layers import check_rope_scaling, rope_inv_freq
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=512, rope_scaling=dict(scaling))
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    ours = check_rope_scaling(rope_scaling_of(config.to_dict()))
    assert ours["rope_type"] == scaling["rope_type"] and ours["factor"] == scaling["factor"]
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, ours), expected.float(), rtol=1e-6, atol=0)
    assert not torch.equal(rope_inv_freq(64, 500000.0, None), expected.float())


def test_both_drafters_take_and_export_the_targets_rope_scaling(tmp_path):
    """A Llama 3.1 style target (rope_parameters with llama3 scaling, as transformers 5 writes it):
    both drafters train with its scaling, and export it at the top level and in rope_parameters."""
    import json
    from drafter_worker.dflash.config import DFlashConfig
    from drafter_worker.dflash.export import config_from_export, export_config
    from drafter_worker.eagle3.config import Eagle3Config
    from drafter_worker.eagle3.export import config_from_export as eagle3_from_export
    from drafter_worker.eagle3.export import export_config as eagle3_export_config
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "rope_parameters": {"rope_theta": 500000.0, **scaling}}))
    dflash = DFlashConfig.from_target(target, layer_ids=[1, 3, 5], block_size=8, num_draft_layers=1, mask_token_id=7)
    eagle3 = Eagle3Config.from_target(target, layer_ids=[1, 3, 4], draft_vocab=100)
    for config, doc, back in ((dflash, export_config(dflash, "bfloat16"), config_from_export),
                              (eagle3, eagle3_export_config(eagle3, "bfloat16"), eagle3_from_export)):
        assert config.target.rope_theta == 500000.0 and config.target.rope_scaling == scaling
        assert doc["rope_theta"] == 500000.0 and doc["rope_scaling"] == scaling
        assert doc["rope_parameters"] == {"rope_theta": 500000.0, **scaling}
        assert back(doc).target.rope_scaling == scaling and back(doc).target.rope_theta == 500000.0
