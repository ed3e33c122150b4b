"""Tiny targets and hidden-state batches for the DFlash tests (random weights, fixed seeds)."""

from __future__ import annotations

import torch

from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.trainer import DFlashTrainer

VOCAB = 300
LAYER_IDS = [1, 2]


def make_target(path, *, seed: int = 0, tie: bool = False, num_layers: int = 4, vocab: int = VOCAB):
    """A random 4-layer Qwen3 (hidden 64) saved with ``save_pretrained``; returns the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=tie, rope_theta=10000.0,
                         initializer_range=0.1)  # larger than the default 0.02: logits with a usable range
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def load_target(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def target_states(target, input_ids: torch.Tensor, layer_ids=LAYER_IDS) -> torch.Tensor:
    """``[B, S, K*H]`` captured states, as the target worker writes them."""
    out = target(input_ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def random_batch(target, *, batch: int, seq_len: int, seed: int, prompt_len: int = 4, states=None):
    """Random tokens, the target's states (``states(target, ids)``, DFlash's capture by default), a
    loss mask after a short prompt, decreasing lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (batch, seq_len), generator=g)
    seq_lens = torch.tensor([seq_len - 3 * i for i in range(batch)])
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for i, n in enumerate(seq_lens.tolist()):
        loss_mask[i, prompt_len:n] = True
        ids[i, n:] = 0  # padding
    return (states or target_states)(target, ids), ids, loss_mask, seq_lens


def backend_config(target_dir, run_dir, *extra: str):
    """The config of a :class:`drafter_worker.dflash_backend.DFlashBackend` on the tiny target: its
    capture layers, a one-layer drafter with 4-token blocks and few anchors."""
    from common.run.config import load_config
    return load_config(None, [f"run.dir={run_dir}", f"target.model={target_dir}",
                              "target.capture_layers=[" + ",".join(map(str, LAYER_IDS)) + "]",
                              "dflash.block_size=4", "dflash.gamma=2.0", "dflash.num_draft_layers=1",
                              "dflash.num_anchors=8", "dflash.lr=0.003", "drafter.checkpoint_keep=2",
                              f"dflash.mask_token_id={VOCAB - 1}",  # random_batch never draws it
                              *extra])


def make_trainer(target_dir, *, seed: int = 0, **overrides) -> DFlashTrainer:
    fields = dict(block_size=4, num_draft_layers=1, gamma=2.0, num_anchors=16, total_steps=100)
    fields.update(overrides)
    return DFlashTrainer(DFlashTrainConfig(**fields), target_dir=str(target_dir), layer_ids=LAYER_IDS,
                         device="cpu", seed=seed)
