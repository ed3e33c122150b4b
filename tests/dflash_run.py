"""A tiny real run for the DFlash worker tests: a random Qwen3 target, a prepared dataset of token
sequences it scores, and the config of a 1-target 1-drafter run on them (fixed seeds throughout)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.run.config import Config, load_config
from common.run.prepared import FORMAT, MANIFEST_FILE
from dflash_testing import VOCAB, make_target
from target_worker.prepare import DatasetWriter

NUM_TARGET_LAYERS = 4
CAPTURE_LAYERS = [1, 2]


def write_dataset(out_dir: Path, lengths: list[int], *, seed: int = 0, prompt_len: int = 4,
                  tokenizer_dir: Path | None = None) -> Path:
    """A prepared dataset (the layout ``hsd prepare`` writes) of random token sequences whose
    loss mask covers everything after a short prompt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = DatasetWriter(out_dir)
    for length in lengths:
        ids = rng.integers(1, VOCAB - 1, size=length).tolist()
        writer.add(ids, [0] * prompt_len + [1] * (length - prompt_len))
    writer.finish()
    manifest = {"format": FORMAT, "num_samples": len(lengths), "num_tokens": int(sum(lengths)),
                "tokenizer": {"fingerprint": _fingerprint(tokenizer_dir)}, "checksums": writer.checksums_section()}
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out_dir


def _fingerprint(tokenizer_dir: Path | None) -> str:
    """The target's tokenizer fingerprint, so the target accepts the dataset as its own."""
    if tokenizer_dir is None:
        return "random-test-tokens"
    from common.run.prepared import load_tokenizer, tokenizer_fingerprint
    return tokenizer_fingerprint(load_tokenizer(tokenizer_dir))


def tiny_run_args(root: Path, run_dir: Path, *, num_samples: int = 32, epochs: int = 1, seed: int = 0,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """Target model and dataset under ``root``; the config overrides of a small real run on them."""
    target_dir = root / "target"
    if not (target_dir / "config.json").is_file():
        make_target(target_dir, num_layers=NUM_TARGET_LAYERS)
    rng = np.random.default_rng(seed)
    data_dir = write_dataset(root / "data", rng.integers(12, 60, size=num_samples).tolist(), seed=seed,
                             tokenizer_dir=target_dir)
    return [
        f"run.dir={run_dir}", f"run.epochs={epochs}", f"run.seed={seed}", f"data.path={data_dir}",
        f"target.model={target_dir}", "target.capture_layers=" + ",".join(map(str, CAPTURE_LAYERS)).join("[]"), "target.count=1",
        "drafter.count=1", "drafter.accum_steps=2", "drafter.checkpoint_every=2",
        "schedule.buckets=[32,64]", "schedule.tokens_per_batch=128", "pool.slots=4", "pool.min_ready=1",
        "dflash.block_size=4", "dflash.gamma=2.0", "dflash.num_draft_layers=1", "dflash.num_anchors=8",
        "dflash.lr=0.002", "dispatcher.heartbeat_s=0.2", "dispatcher.worker_timeout_s=5",
        # The random target has no tokenizer of its own; the data's tokens are 1 .. VOCAB - 2.
        f"dflash.mask_token_id={VOCAB - 1}", *extra]


def tiny_run(root: Path, run_dir: Path, **kwargs) -> Config:
    return load_config(None, tiny_run_args(root, run_dir, **kwargs))
