"""The EAGLE-3 micro-batch as first written, kept as the reference the trainer is tested against: a
dense boolean TTT mask over every key of every step, and the loss over the supervised positions
selected by boolean masks (each a host read on a GPU). The trainer now does neither; its loss and
gradients must stay what this computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter_worker.eagle3.config import NUM_FUSED_LAYERS
from drafter_worker.eagle3.loss import soft_ce
from drafter_worker.eagle3.ttt import shift_left, step_targets, ttt_mask
from drafter_worker.layers import apply_rope, rope_cos_sin


def _dense_step(model, hidden, tokens, positions, cache, mask):
    layer, attn = model.midlayer, model.midlayer.self_attn
    embed = model.embed_tokens(tokens).to(model.fc.weight.dtype)
    dims = model.config.target
    rope = rope_cos_sin(positions, dims.head_dim, dims.rope_theta, dims.rope_scaling)
    x = torch.cat([layer.input_layernorm(embed), layer.hidden_norm(hidden)], dim=-1)
    q = apply_rope(attn._heads(attn.q_proj(x), attn.num_heads), *rope)
    k = apply_rope(attn._heads(attn.k_proj(x), attn.num_kv_heads), *rope)
    cache.append((k, attn._heads(attn.v_proj(x), attn.num_kv_heads)))
    groups = attn.num_heads // attn.num_kv_heads
    keys = torch.cat([c[0] for c in cache], dim=2).repeat_interleave(groups, dim=1)
    values = torch.cat([c[1] for c in cache], dim=2).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    stream = hidden + attn.o_proj(out.transpose(1, 2).flatten(2))
    stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
    return stream, model.norm(stream)


def reference_micro_batch(trainer, hs, input_ids, loss_mask, seq_lens):
    """(weighted sum, total weight, predicted positions per step); the gradients land in the trainer's model."""
    model, hidden_size = trainer.model, trainer.model_config.target.hidden_size
    input_ids, loss_mask, seq_lens = input_ids.long(), loss_mask.bool(), seq_lens.long()
    batch, seq_len = input_ids.shape
    with torch.no_grad():
        logits = F.linear(hs[..., -hidden_size:], trainer.target_head).float()
        in_vocab = model.t2d[logits.argmax(-1)]
        probs = logits[..., model.t2d.nonzero().squeeze(1)].softmax(-1)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    hidden, cache = model.fuse(hs[..., :NUM_FUSED_LAYERS * hidden_size]), []
    total, weight_total, counts = torch.zeros(()), 0.0, []
    for k, weight in enumerate(trainer.weights):
        tokens, predicted = step_targets(input_ids, loss_mask, seq_lens, k)
        supervised = predicted & shift_left(in_vocab, 1 + k, fill=False)
        hidden, normed = _dense_step(model, hidden, tokens, positions + k, cache, ttt_mask(seq_len, k))
        step_sum, _ = soft_ce(model.lm_head(normed[supervised]), shift_left(probs, 1 + k)[supervised])
        total = total + weight * step_sum
        weight_total += weight * int(supervised.sum())
        counts.append(int(predicted.sum()))
    total.backward()
    return float(total), weight_total, counts
