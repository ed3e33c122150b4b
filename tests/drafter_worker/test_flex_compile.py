"""Flex attention and its block mask compile one graph each, whatever the job's shape: batches of
one, of several, of other lengths and anchor counts all run the first graphs. Dynamo's graph count
does not depend on the backend lowering it, so the test counts with ``aot_eager``, which runs on
the CPU (inductor's CPU code for the mask does not build here); the outputs are checked against the
dense SDPA reference."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from drafter_worker import flex_compile
from drafter_worker.dflash.mask import dense_block_mask, flex_block_mask

pytest.importorskip("torch.nn.attention.flex_attention")

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 16


def test_one_graph_each_for_every_shape(monkeypatch):
    monkeypatch.setattr(flex_compile, "BACKEND", "aot_eager")
    monkeypatch.setattr(flex_compile, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for batch, num_blocks, ctx_len in [(2, 4, 32), (3, 5, 48), (1, 4, 32), (4, 6, 64), (1, 7, 80), (2, 3, 96)]:
        anchors = torch.randint(1, ctx_len, (batch, num_blocks), generator=g)
        num_q = num_blocks * BLOCK
        q = torch.randn(batch, HEADS, num_q, HEAD_DIM, generator=g)
        k = torch.randn(batch, KV_HEADS, ctx_len + num_q, HEAD_DIM, generator=g)
        v = torch.randn(batch, KV_HEADS, ctx_len + num_q, HEAD_DIM, generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex attention run by aot_eager warns that it is unfused
            block_mask = flex_block_mask(anchors, ctx_len=ctx_len, block_size=BLOCK, compiled=True)
            out = flex_compile.flex_attention(q, k, v, block_mask, compiled=True)
        mask = dense_block_mask(anchors, ctx_len=ctx_len, block_size=BLOCK)
        groups = HEADS // KV_HEADS
        reference = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                   attn_mask=mask)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2  # the block mask's and flex attention's
    torch._dynamo.reset()


def test_eagle3_ttt_attention_compiles_once_for_every_length_and_step(monkeypatch):
    """The TTT block mask (cached per length and step) and flex attention over the keys of every step:
    one graph each for four lengths (one batch of one) and three steps, equal to the dense TTT mask."""
    from drafter_worker.eagle3 import ttt_attention as ttt
    from drafter_worker.eagle3.ttt import ttt_mask
    monkeypatch.setattr(flex_compile, "BACKEND", "aot_eager")
    monkeypatch.setattr(flex_compile, "_compiled", {})
    monkeypatch.setattr(ttt, "_block_masks", type(ttt._block_masks)())
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for batch, seq_len in [(2, 10), (3, 17), (1, 9), (2, 40)]:
        q = torch.randn(batch, HEADS, seq_len, HEAD_DIM, generator=g)
        cache = []
        for step in range(3):
            cache.append((torch.randn(batch, KV_HEADS, seq_len, HEAD_DIM, generator=g),
                          torch.randn(batch, KV_HEADS, seq_len, HEAD_DIM, generator=g)))
            groups = HEADS // KV_HEADS
            keys = torch.cat([k for k, _ in cache], dim=2).repeat_interleave(groups, 1)
            values = torch.cat([v for _, v in cache], dim=2).repeat_interleave(groups, 1)
            reference = F.scaled_dot_product_attention(q, keys, values, attn_mask=ttt_mask(seq_len, step))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = ttt.ttt_attention(q, cache, kind="flex", compiled=True)
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
