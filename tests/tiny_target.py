"""Tiny Hugging Face targets (random weights, built from a config, saved to a directory) and sample
sources for the target-worker tests: nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from common.run.config import Config, load_config

VOCAB = 97


def save_tiny_model(kind: str, path: Path, *, num_layers: int = 8, seed: int = 0) -> Path:
    """A randomly initialised ``kind`` (qwen3, llama, mistral, gemma3, gemma2) causal LM saved as a local model directory."""
    import transformers as tf
    classes = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}), "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
               # Gemma 3: embedding scaling, sandwich norms and alternating sliding-window layers.
               "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {"sliding_window": 8}),
               # Gemma 2: attention logit softcapping, hence no SDPA kernel in transformers (eager or flash).
               "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"sliding_window": 8})}
    config_class, model_class, extra = classes[kind]
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                          tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model_class(config).save_pretrained(path)
    return path


class ListSamples:
    """An in-memory sample source: ``sample(i) -> (input_ids, loss_mask)``."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]]):
        self.samples = samples
        self.lengths = [len(ids) for ids, _ in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.samples[index]


def random_samples(lengths: list[int], *, seed: int = 0) -> ListSamples:
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        ids = rng.integers(1, VOCAB, size=length).astype(np.int32)
        mask = (np.arange(length) >= length // 3).astype(np.uint8)  # the "prompt" third is not trained on
        samples.append((ids, mask))
    return ListSamples(samples)


class NpzSamples(ListSamples):
    """A minimal on-disk dataset for command tests: ``samples.npz`` with ids_i / mask_i arrays."""

    FILE = "samples.npz"
    fingerprint = "npz-test-set"

    @classmethod
    def write(cls, directory: Path, source: ListSamples) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for i, (ids, mask) in enumerate(source.samples):
            arrays[f"ids_{i}"], arrays[f"mask_{i}"] = ids, mask
        np.savez(directory / cls.FILE, **arrays)
        (directory / "lengths.txt").write_text("".join(f"{n}\n" for n in source.lengths))
        return directory

    @classmethod
    def open(cls, directory: str | Path) -> NpzSamples:
        with np.load(Path(directory) / cls.FILE, allow_pickle=False) as data:
            count = len(data.files) // 2
            return cls([(data[f"ids_{i}"], data[f"mask_{i}"]) for i in range(count)])


def tiny_config(tmp_path: Path, model_dir: Path, *extra: str) -> Config:
    return load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.model={model_dir}",
                              "schedule.buckets=[16, 32, 64]", "schedule.tokens_per_batch=128",
                              "target.num_capture_layers=3", "pool.slots=4", "pool.min_ready=1", *extra])
