"""Gradients are summed in buckets: small tensors share a collective, large ones go alone, and every
tensor ends up with its own sum. The collective here doubles in place, which is what summing over two
ranks holding the same tensors gives; tests/drafter_worker/test_data_parallel_step.py runs real gloo."""

import torch

from drafter_worker.process_group import all_reduce_flat


def test_small_tensors_share_a_collective_and_large_ones_go_alone():
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(3, 4, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]
    large = torch.randn(300, generator=g)          # 1,200 bytes: at the bucket size, summed as it is
    other_dtype = torch.tensor([1.5, 2.5], dtype=torch.float64)
    tensors = small[:2] + [large, other_dtype, small[2]]
    before = [t.clone() for t in tensors]
    calls = []

    def double(t):
        calls.append((str(t.dtype), t.numel()))
        t.mul_(2)

    all_reduce_flat(tensors, double, bucket_bytes=1200)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b * 2)
    assert sorted(calls) == sorted([("torch.float32", 300), ("torch.float32", 12 + 7 + 8), ("torch.float64", 2)])


def test_a_full_bucket_is_sent_before_the_next_one_starts():
    tensors = [torch.ones(10) * i for i in range(5)]  # 40 bytes each
    calls = []
    all_reduce_flat(tensors, lambda t: (calls.append(t.numel()), t.mul_(2)), bucket_bytes=100)
    assert calls == [20, 20, 10]
    assert all(torch.equal(t, torch.ones(10) * 2 * i) for i, t in enumerate(tensors))
