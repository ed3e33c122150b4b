"""The EAGLE-3 draft model: one Llama decoder layer ("midlayer") over the token embedding and a
fused hidden state, and an LM head over the draft vocabulary.

One step at position ``t``: ``x = concat(input_layernorm(embed(token)), hidden_norm(hidden))``
(``2 × H`` wide) feeds q/k/v; the residual stream starts from ``hidden`` itself; attention,
``post_attention_layernorm``, SwiGLU MLP; ``norm`` then ``lm_head`` give the draft logits, and the
stream before ``norm`` is the hidden state the next step reads. At step 0 ``hidden`` is
``fc(concat(three target layers))``; the chain of later steps is :mod:`drafter_worker.eagle3.ttt`'s.

Parameter names are those of the published EAGLE-3 checkpoints (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, plus the ``d2t``/``t2d`` buffers), so :meth:`Eagle3DraftModel.draft_state_dict` is
saved as is. The embedding is the target's, frozen, and not exported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafter_worker.draft_tensors import DraftTensors
from drafter_worker.eagle3.config import NUM_FUSED_LAYERS, Eagle3Config
from drafter_worker.eagle3.family import OBJECTIVE
from drafter_worker.eagle3.ttt_attention import KVCache, ttt_attention
from drafter_worker.eagle3.vocab import check_vocab
from drafter_worker.layers import RMSNorm, SwiGLUMLP, apply_rope, load_target_head, rope_cos_sin

SHARED_PREFIXES = ("embed_tokens.",)  # the target's embedding: never trained, never exported

class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        dims = config.target
        h, d = dims.hidden_size, dims.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_attention_heads, dims.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)  # [B, heads, T, D]

    def forward(self, x_BT2H, rope, cache: KVCache, ttt: str | None) -> torch.Tensor:
        """Queries of this step attend to the keys of the steps in ``cache`` and its own (appended):
        under the training-time test's pattern with kernel ``ttt`` (:mod:`drafter_worker.eagle3.ttt_attention`),
        or every key when ``ttt`` is None (a drafted token at inference, after the prefix)."""
        q = apply_rope(self._heads(self.q_proj(x_BT2H), self.num_heads), *rope)
        k = apply_rope(self._heads(self.k_proj(x_BT2H), self.num_kv_heads), *rope)
        v = self._heads(self.v_proj(x_BT2H), self.num_kv_heads)
        cache.append((k, v))
        if ttt is not None:
            out = ttt_attention(q, cache, kind=ttt)
        else:
            keys, values = torch.cat([c[0] for c in cache], dim=2), torch.cat([c[1] for c in cache], dim=2)
            groups = self.num_heads // self.num_kv_heads
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype))
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.target.hidden_size, config.target.intermediate_size)

    def forward(self, embed_BTH, hidden_BTH, rope, cache: KVCache, ttt: str | None) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embed_BTH), self.hidden_norm(hidden_BTH)], dim=-1)
        stream = hidden_BTH + self.self_attn(x, rope, cache, ttt)
        return stream + self.mlp(self.post_attention_layernorm(stream))


class Eagle3DraftModel(DraftTensors):
    SHARED_PREFIXES = SHARED_PREFIXES
    objective = OBJECTIVE  # its drafter family, which makes its proposer for hsd eval

    def __init__(self, config: Eagle3Config, *, embed_weight: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        self.config = config
        if tuple(embed_weight.shape) != (config.target.vocab_size, config.target.hidden_size):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} does not match the drafter's "
                             f"(vocab_size, hidden_size) = ({config.target.vocab_size}, {config.target.hidden_size})")
        if d2t.numel() != config.draft_vocab_size or t2d.numel() != config.target.vocab_size:
            raise ValueError(f"d2t of {d2t.numel()} and t2d of {t2d.numel()} entries for a draft vocabulary of "
                             f"{config.draft_vocab_size} over {config.target.vocab_size} target tokens")
        check_vocab(d2t, t2d)
        h = config.target.hidden_size
        self.fc = nn.Linear(NUM_FUSED_LAYERS * h, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.target.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.attention = "structured"  # the TTT attention kernel (ttt_attention); the trainer picks flex on GPUs

    def load_draft_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        check_vocab(state["d2t"].long(), state["t2d"].bool())
        super().load_draft_state_dict(state)

    def fuse(self, aux_BT3H: torch.Tensor) -> torch.Tensor:
        """The step-0 hidden state from the three captured target layers."""
        return self.fc(aux_BT3H.to(self.fc.weight.dtype))

    def step(self, hidden_BTH, tokens_BT, positions_BT, cache: KVCache, *, ttt: bool = False):
        """One step: (stream ``[B, T, H]`` the next step reads, normed output for :meth:`logits`).

        ``ttt``: the step sees keys as the training-time test lets it (step 0 causal, each later
        step its own position's key of every earlier step); otherwise every key in ``cache``."""
        embed = self.embed_tokens(tokens_BT).to(self.fc.weight.dtype)
        dims = self.config.target
        rope = rope_cos_sin(positions_BT, dims.head_dim, dims.rope_theta, dims.rope_scaling)
        stream = self.midlayer(embed, hidden_BTH, rope, cache, self.attention if ttt else None)
        return stream, self.norm(stream)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (map an argmax to a target id with ``d2t``)."""
        return self.lm_head(normed)



def build_drafter(config: Eagle3Config, target_dir, *, d2t: torch.Tensor, t2d: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> tuple[Eagle3DraftModel, torch.Tensor]:
    """An untrained drafter with the target's embedding, and the target's LM head ``[V, H]`` (frozen,
    in ``dtype``: the trainer turns the captured final-norm states into the target's logits with it)."""
    embed, head = load_target_head(target_dir)
    embed = embed.to(dtype)
    head = embed if head is embed else head.to(dtype)
    return Eagle3DraftModel(config, embed_weight=embed, d2t=d2t, t2d=t2d), head
