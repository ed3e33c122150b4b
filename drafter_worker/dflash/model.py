"""The DFlash draft model: a few Qwen3-style decoder layers that denoise a block of masked tokens,
conditioned on the target's hidden states.

Data flow for one sequence with anchors ``a_1..a_N`` (block size ``B``):

* context: the captured target layers ``[S, K*H]`` are fused once, ``ctx = hidden_norm(fc(hs))``,
  and the same ``ctx`` feeds every draft layer;
* blocks: block j holds the token at ``a_j`` then ``B-1`` mask tokens, embedded with the target's
  (frozen) embedding, at RoPE positions ``a_j .. a_j+B-1``;
* each layer takes its queries from the blocks only; its keys and values are
  ``[k_proj(ctx), k_proj(block)]`` and ``[v_proj(ctx), v_proj(block)]`` ("KV injection": the
  context never runs through the MLP or the query/output projections), under the block-sparse
  mask of :mod:`drafter_worker.dflash.mask`, computed by :mod:`drafter_worker.dflash.attention`
  without the keys it forbids;
* the final norm and the target's (frozen) LM head give the logits of block positions 1..B-1.

Parameter names follow the published DFlash checkpoint layout (``fc``, ``hidden_norm``,
``layers.{i}.self_attn.q_proj``, ..., ``norm``) so that :meth:`DFlashDraftModel.draft_state_dict`
can be saved as is and served without conversion.
"""

from __future__ import annotations

import torch
from torch import nn

from drafter_worker.dflash.config import DFlashConfig
from drafter_worker.dflash.attention import DraftAttention, attention_kind
from drafter_worker.dflash.family import OBJECTIVE
from drafter_worker.dflash.mask import block_positions
from drafter_worker.draft_tensors import DraftTensors
from drafter_worker.layers import RMSNorm, SwiGLUMLP, apply_rope, load_target_head, rope_cos_sin

SHARED_PREFIXES = ("embed_tokens.", "lm_head.")  # the target's tensors: never trained, never exported


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        dims = config.target
        h, d = dims.hidden_size, dims.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_attention_heads, dims.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.target.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.target.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)  # [B, heads, T, D]

    def forward(self, x_BQH, ctx_BSH, rope_q, rope_ctx, attend: DraftAttention) -> torch.Tensor:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x_BQH), self.num_heads)), *rope_q)
        k_ctx = apply_rope(self.k_norm(self._heads(self.k_proj(ctx_BSH), self.num_kv_heads)), *rope_ctx)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x_BQH), self.num_kv_heads)), *rope_q)
        v_ctx = self._heads(self.v_proj(ctx_BSH), self.num_kv_heads)
        v_blk = self._heads(self.v_proj(x_BQH), self.num_kv_heads)
        # Under autocast the norms (float32 weights) leave q and k in float32 while v comes out of a
        # matmul in bfloat16; flex attention, unlike SDPA, does not reconcile them.
        q, k_ctx, k_blk = q.to(v_blk.dtype), k_ctx.to(v_blk.dtype), k_blk.to(v_blk.dtype)
        out = attend(q, k_ctx, v_ctx, k_blk, v_blk)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.target.hidden_size, config.target.intermediate_size)

    def forward(self, x_BQH, ctx_BSH, rope_q, rope_ctx, attend: DraftAttention) -> torch.Tensor:
        x_BQH = x_BQH + self.self_attn(self.input_layernorm(x_BQH), ctx_BSH, rope_q, rope_ctx, attend)
        return x_BQH + self.mlp(self.post_attention_layernorm(x_BQH))


class DFlashDraftModel(DraftTensors):
    SHARED_PREFIXES = SHARED_PREFIXES
    objective = OBJECTIVE  # its drafter family, which makes its proposer for hsd eval

    def __init__(self, config: DFlashConfig, *, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.config = config
        if tuple(embed_weight.shape) != (config.target.vocab_size, config.target.hidden_size):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} does not match the drafter's "
                             f"(vocab_size, hidden_size) = ({config.target.vocab_size}, {config.target.hidden_size})")
        num_fused = config.num_context_layers * config.target.hidden_size
        self.fc = nn.Linear(num_fused, config.target.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_draft_layers))
        self.norm = RMSNorm(config.target.hidden_size, config.target.rms_norm_eps)
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        # On the meta device: the real weight is the target's, allocating another would be wasted.
        self.lm_head = nn.Linear(config.target.hidden_size, config.target.vocab_size, bias=False, device="meta")
        if lm_head_weight is embed_weight:  # tied target: one tensor, moved and cast once
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)
        # "sdpa" (block-sparse SDPA kernels on the CPU), "flex" (GPU) or "dense" (the reference):
        # set by whoever places the model on a device.
        self.attention = "sdpa"

    def forward(self, hs_BSD: torch.Tensor, input_ids_BS: torch.Tensor, anchors_BN: torch.Tensor) -> torch.Tensor:
        """Final hidden states of every block position ``[B, N, block_size, H]``.

        ``hs_BSD`` are the captured target layers (padded to ``S``), ``anchors_BN`` the anchors
        (``PAD_ANCHOR`` for unused slots). Rows of padded anchors are garbage: callers mask them.
        """
        config = self.config
        batch, ctx_len, _ = hs_BSD.shape
        num_blocks, block = anchors_BN.shape[1], config.block_size
        ctx = self.hidden_norm(self.fc(hs_BSD.to(self.fc.weight.dtype)))

        starts = anchors_BN.clamp(min=0)
        tokens = torch.full((batch, num_blocks, block), config.mask_token_id, dtype=torch.long,
                            device=input_ids_BS.device)
        tokens[:, :, 0] = torch.gather(input_ids_BS, 1, starts)
        x = self.embed_tokens(tokens.flatten(1)).to(self.fc.weight.dtype)  # [B, N*block, H]

        pos_q = block_positions(starts, block)
        pos_ctx = torch.arange(ctx_len, device=hs_BSD.device).expand(batch, ctx_len)
        rope_q = rope_cos_sin(pos_q, config.target.head_dim, config.target.rope_theta, config.target.rope_scaling)
        rope_ctx = rope_cos_sin(pos_ctx, config.target.head_dim, config.target.rope_theta, config.target.rope_scaling)
        attend = DraftAttention(anchors_BN, ctx_len=ctx_len, block_size=block,
                                kind=attention_kind(self.attention, hs_BSD.device))
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_ctx, attend)
        return self.norm(x).view(batch, num_blocks, block, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))



def build_drafter(config: DFlashConfig, target_dir, *, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A drafter with the target's embedding and LM head (read from ``target_dir``), untrained."""
    embed, head = load_target_head(target_dir)
    if 0 <= config.mask_token_id < embed.shape[0] and not bool(embed[config.mask_token_id].any()):
        # A zero row makes every masked position's first query zero, which RoPE cannot rotate: the
        # first layer could not tell the block's positions apart.
        raise ValueError(f"the target's embedding row {config.mask_token_id} (mask_token_id) is all zeros: "
                         f"choose another mask token")
    embed = embed.to(dtype)
    head = embed if head is embed else head.to(dtype)
    return DFlashDraftModel(config, embed_weight=embed, lm_head_weight=head)

