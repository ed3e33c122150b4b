"""Tiny random Qwen3 targets saved to a temporary directory, shared by the DFlash tests."""

from __future__ import annotations

import pytest
import torch


def make_target(path, *, seed: int = 0, tie: bool = False, num_layers: int = 4, vocab: int = 300):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=tie, rope_theta=10000.0)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_target(path)
    return path


@pytest.fixture(scope="session")
def tiny_tied_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied_target")
    make_target(path, tie=True, seed=1)
    return path
