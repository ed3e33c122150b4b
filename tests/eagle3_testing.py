"""Hidden-state batches, prepared datasets and trainers for the EAGLE-3 tests, on the tiny random
targets of :mod:`dflash_testing` (4 layers, hidden 64, vocabulary 300)."""

from __future__ import annotations

import json

import numpy as np
import torch

from common.run.prepared import FORMAT, LENGTHS_FILE, LOSS_MASK_FILE, MANIFEST_FILE, OFFSETS_FILE, TOKENS_FILE
from dflash_testing import VOCAB
from dflash_testing import random_batch as dflash_random_batch

LAYER_IDS = [0, 1, 2]  # three layers of the 4-layer tiny target (its default 1, 1, 0 is not three layers)
DRAFT_VOCAB = 200


@torch.no_grad()
def eagle3_states(target, input_ids: torch.Tensor, layer_ids=LAYER_IDS) -> torch.Tensor:
    """``[B, S, 4*H]``: the three layers, then the final-norm state, as the target worker writes them."""
    out = target(input_ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids] + [out.hidden_states[-1]], dim=-1)


def random_batch(target, *, batch: int, seq_len: int, seed: int, prompt_len: int = 4):
    return dflash_random_batch(target, batch=batch, seq_len=seq_len, seed=seed, prompt_len=prompt_len,
                               states=eagle3_states)


def write_prepared(path, samples: list[tuple[list[int], list[int]]]):
    """A prepared dataset directory (the files ``hsd prepare`` writes) of ``(tokens, loss_mask)`` samples."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([np.asarray(t, dtype="<u4") for t, _ in samples])
    masks = np.concatenate([np.asarray(m, dtype="u1") for _, m in samples])
    offsets = np.concatenate([[0], np.cumsum([len(t) for t, _ in samples])]).astype("<u8")
    (path / TOKENS_FILE).write_bytes(tokens.tobytes())
    (path / LOSS_MASK_FILE).write_bytes(masks.tobytes())
    (path / OFFSETS_FILE).write_bytes(offsets.tobytes())
    (path / LENGTHS_FILE).write_text("".join(f"{len(t)}\n" for t, _ in samples))
    (path / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "num_samples": len(samples),
                                                  "num_tokens": int(len(tokens)),
                                                  "tokenizer": {"fingerprint": "test"}}))
    return path


def random_prepared(path, *, num_samples: int = 24, seed: int = 0):
    """Random samples whose response tokens favour the low ids (so the draft vocabulary is not all of them)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        n = int(torch.randint(12, 40, (1,), generator=g))
        ids = (torch.rand(n, generator=g) ** 2 * (VOCAB - 1)).long().tolist()
        samples.append((ids, [0] * 4 + [1] * (n - 4)))
    return write_prepared(path, samples)


def backend_config(target_dir, run_dir, data_dir, *extra: str):
    """An EAGLE-3 backend's config on the tiny target: three layers, 3 TTT steps, a 200-token draft vocabulary."""
    from common.run.config import load_config
    return load_config(None, [f"run.dir={run_dir}", f"target.model={target_dir}", f"data.path={data_dir}",
                              "drafter.objective=eagle3", "target.capture_layers=[" + ",".join(map(str, LAYER_IDS)) + "]",
                              "eagle3.ttt_steps=3", f"eagle3.draft_vocab={DRAFT_VOCAB}", "eagle3.lr=0.003",
                              "drafter.checkpoint_keep=2", *extra])


def make_trainer(target_dir, *, seed: int = 0, ttt_steps: int = 3, d2t=None, t2d=None, **overrides):
    from drafter_worker.eagle3.config import Eagle3TrainConfig
    from drafter_worker.eagle3.trainer import Eagle3Trainer
    from drafter_worker.eagle3.vocab import draft_vocab_from_counts
    if d2t is None:
        d2t, t2d = draft_vocab_from_counts(np.arange(VOCAB)[::-1].copy(), DRAFT_VOCAB)  # the low ids
    fields = dict(ttt_steps=ttt_steps, draft_vocab=d2t.numel(), total_steps=100, lr=3e-3)
    fields.update(overrides)
    return Eagle3Trainer(Eagle3TrainConfig(**fields), target_dir=str(target_dir), layer_ids=LAYER_IDS,
                         device="cpu", seed=seed, d2t=d2t, t2d=t2d)
