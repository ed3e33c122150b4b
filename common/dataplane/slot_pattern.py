"""A deterministic slot content for sim workers, so every handoff can be checked end to end.

A sim target fills a slot with a pattern that depends only on the job id and the position of each
element; the drafter that receives the job recomputes it from the job id it was given and compares
bit for bit. A stale slot (another job's data), a torn copy or a misplaced row shows up as a
:class:`SlotIntegrityError` instead of silently training on garbage.

Hidden states are generated as integer bit patterns and reinterpreted as the slot dtype. The top
exponent bit and the sign bit are cleared so every value is a finite, non-negative number (no
NaN/Inf, which a sim drafter's arithmetic would propagate), and the comparison is done on the bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from common.dataplane.slots import SlotHeader, SlotView

_BITS = {torch.bfloat16: (torch.int16, 0x3FFF), torch.float16: (torch.int16, 0x3FFF),
         torch.float32: (torch.int32, 0x3FFFFFFF)}
_OFFSET_RANGE = 1 << 20
_MAX_ELEMENTS = (1 << 31) - _OFFSET_RANGE  # int32 positions plus a job offset must not overflow
_iota_cache: dict[torch.device, torch.Tensor] = {}
_table_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
# Slots of up to 2^22 elements (a small one first), then up to 2^25, read their pattern from a table (at most
# 66 MiB of int16 patterns, 132 of int32, per device); a larger slot's is computed for each job.
_TABLE_SIZES = (1 << 22, 1 << 25)


class SlotIntegrityError(RuntimeError):
    """The data read for a job is not what its target wrote."""

    def __init__(self, job_id: int, what: str):
        super().__init__(f"slot data of job {job_id} is corrupt: {what}")
        self.job_id = job_id
        self.what = what


def _iota(n: int, device: torch.device) -> torch.Tensor:
    # Reused across jobs: regenerating positions each time would double the cost of a fill.
    cached = _iota_cache.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(n, dtype=torch.int32, device=device)
        _iota_cache[device] = cached
    return cached[:n]


def _job_offset(job_id: int, salt: int) -> int:
    return (job_id * 40503 + salt) % _OFFSET_RANGE


def _bits_table(dtype: torch.dtype, length: int, device: torch.device) -> torch.Tensor:
    """Every value of the pattern ``g(x) = (x ^ (x >> 13)) & mask`` for ``x`` in ``[0, length)``.

    A job's pattern is ``g(position + offset)``, a slice of this table: a fill is then one copy and a
    check one comparison, instead of four passes over the slot to compute it each time."""
    int_dtype, mask = _BITS[dtype]
    key = (int_dtype, device)
    cached = _table_cache.get(key)
    if cached is None or cached.numel() < length:
        v = torch.arange(length, dtype=torch.int32, device=device)
        v ^= v >> 13  # fold high position bits into the kept low ones, so rows far apart still differ
        v &= mask
        cached = _table_cache[key] = v.to(int_dtype)
    return cached


def _hs_bits(job_id: int, num_elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype not in _BITS:
        raise ValueError(f"no integrity pattern for dtype {dtype}")
    if num_elements > _MAX_ELEMENTS:
        raise ValueError(f"{num_elements} hidden-state elements exceed the pattern's int32 range")
    offset = _job_offset(job_id, 12345)
    for bound in _TABLE_SIZES:
        if num_elements <= bound:
            return _bits_table(dtype, bound + _OFFSET_RANGE, device)[offset:offset + num_elements]
    int_dtype, mask = _BITS[dtype]  # a slot too large to tabulate: computed for the job
    v = _iota(num_elements, device) + offset
    v ^= v >> 13
    v &= mask
    return v.to(int_dtype)


def _ids_and_mask(job_id: int, seq_lens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids ``[B*S]`` int32 (0 at padding) and loss_mask ``[B*S]`` uint8 for a padded batch."""
    device = seq_lens.device
    batch_size = seq_lens.numel()
    rows = _iota(batch_size * seq_len, device)
    valid = (torch.arange(seq_len, dtype=torch.int32, device=device)[None, :] < seq_lens[:, None]).reshape(-1)
    ids = ((rows + _job_offset(job_id, 777)) ^ (rows >> 7)) & 0x7FFF
    ids = torch.where(valid, ids + 1, 0).to(torch.int32)
    mask = (valid & (((rows ^ (job_id & 7)) & 7) != 0)).to(torch.uint8)
    return ids, mask


def fill_pattern(view: SlotView, *, job_id: int, generation: int, bucket: int, batch_size: int, seq_len: int,
                 seq_lens: Sequence[int]) -> None:
    """Write job ``job_id``'s pattern into the slot with the stale-read protocol (header last)."""
    layout = view.layout
    if len(seq_lens) != batch_size:
        raise ValueError(f"{len(seq_lens)} sequence lengths for a batch of {batch_size}")
    if any(not 0 < n <= seq_len for n in seq_lens):
        raise ValueError(f"sequence lengths must be in [1, {seq_len}], got {list(seq_lens)}")
    rows = batch_size * seq_len
    if batch_size > layout.max_seqs or rows > layout.tokens_per_batch:
        raise ValueError(f"a batch of {batch_size} × {seq_len} does not fit a slot of {layout.tokens_per_batch} "
                         f"tokens / {layout.max_seqs} sequences")
    view.begin_write()
    int_dtype = _BITS[layout.torch_dtype][0]
    view.hs[:rows].view(int_dtype).view(-1).copy_(
        _hs_bits(job_id, rows * layout.row_width, layout.torch_dtype, view.device))
    lens = torch.tensor(list(seq_lens), dtype=torch.int32).to(view.device)
    ids, mask = _ids_and_mask(job_id, lens, seq_len)
    view.input_ids[:rows].copy_(ids)
    view.loss_mask[:rows].copy_(mask)
    view.seq_lens[:batch_size].copy_(lens)
    view.write_header(SlotHeader(generation=generation, job_id=job_id, bucket=bucket, batch_size=batch_size,
                                 seq_len=seq_len, num_tokens=sum(seq_lens)))


def _first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> int:
    return int((actual.reshape(-1) != expected.reshape(-1)).nonzero()[0, 0].item())


def verify_pattern(hs: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: torch.Tensor, *,
                   job_id: int, expected_seq_lens: Sequence[int] | None = None) -> None:
    """Check a batch copied out of a slot against job ``job_id``'s pattern, bit for bit.

    ``hs`` is ``[B, S, K*H]`` or ``[B*S, K*H]``, ``input_ids``/``loss_mask`` ``[B, S]`` or ``[B*S]``.
    """
    batch_size = seq_lens.numel()
    rows = input_ids.numel()
    if batch_size == 0 or rows % batch_size:
        raise SlotIntegrityError(job_id, f"{rows} token rows do not split into {batch_size} sequences")
    seq_len = rows // batch_size
    if loss_mask.numel() != rows or hs.numel() % rows:
        raise SlotIntegrityError(job_id, f"shapes disagree: hs {tuple(hs.shape)}, input_ids {tuple(input_ids.shape)}, "
                                         f"loss_mask {tuple(loss_mask.shape)}")
    lens = seq_lens.to(torch.int32).reshape(-1)
    if expected_seq_lens is not None and lens.tolist() != list(expected_seq_lens):
        raise SlotIntegrityError(job_id, f"seq_lens {lens.tolist()} != expected {list(expected_seq_lens)}")
    if bool(((lens <= 0) | (lens > seq_len)).any()):
        raise SlotIntegrityError(job_id, f"seq_lens {lens.tolist()} outside [1, {seq_len}]")

    if hs.dtype not in _BITS:
        raise SlotIntegrityError(job_id, f"unexpected hidden-state dtype {hs.dtype}")
    row_width = hs.numel() // rows
    actual_bits = hs.contiguous().view(_BITS[hs.dtype][0]).reshape(-1)
    expected_bits = _hs_bits(job_id, hs.numel(), hs.dtype, hs.device)
    if not torch.equal(actual_bits, expected_bits):
        index = _first_mismatch(actual_bits, expected_bits)
        raise SlotIntegrityError(job_id, f"hs differs first at row {index // row_width}, column {index % row_width}")

    ids, mask = _ids_and_mask(job_id, lens, seq_len)
    actual_ids = input_ids.reshape(-1).to(torch.int32)
    if not torch.equal(actual_ids, ids):
        raise SlotIntegrityError(job_id, f"input_ids differ first at row {_first_mismatch(actual_ids, ids)}")
    actual_mask = loss_mask.reshape(-1).to(torch.uint8)
    if not torch.equal(actual_mask, mask):
        raise SlotIntegrityError(job_id, f"loss_mask differs first at row {_first_mismatch(actual_mask, mask)}")


def verify_against_dataset(hs: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                           seq_lens: torch.Tensor, *, job_id: int, samples: Sequence[int], dataset: Any) -> None:
    """Check a batch a real target wrote against the prepared dataset it read: each sequence's token ids,
    loss mask and length equal the dataset's sample, its hidden states are finite and not all zero,
    and the padding after it is zero. The dataset is the witness here; the target's forward is not."""
    if seq_lens.numel() != len(samples):
        raise SlotIntegrityError(job_id, f"{seq_lens.numel()} sequences in the slot, the job has {len(samples)}")
    batch_size = len(samples)
    ids = input_ids.reshape(batch_size, -1)
    mask = loss_mask.reshape(batch_size, -1)
    states = hs.reshape(batch_size, ids.shape[1], -1)
    for row, sample in enumerate(samples):
        want_ids, want_mask = dataset.sample(sample)
        length = int(seq_lens[row])
        if length != len(want_ids):
            raise SlotIntegrityError(job_id, f"sequence {row} (sample {sample}) has {length} tokens, the dataset {len(want_ids)}")
        if not torch.equal(ids[row, :length].to(torch.int64), torch.as_tensor(want_ids, dtype=torch.int64)):
            raise SlotIntegrityError(job_id, f"sequence {row} (sample {sample}): token ids differ from the dataset")
        if not torch.equal(mask[row, :length].to(torch.int64), torch.as_tensor(want_mask, dtype=torch.int64)):
            raise SlotIntegrityError(job_id, f"sequence {row} (sample {sample}): loss mask differs from the dataset")
        real = states[row, :length].float()
        if not torch.isfinite(real).all() or not real.abs().sum() > 0:
            raise SlotIntegrityError(job_id, f"sequence {row} (sample {sample}): hidden states are not finite or all zero")
        if ids[row, length:].any() or states[row, length:].abs().sum() > 0:
            raise SlotIntegrityError(job_id, f"sequence {row} (sample {sample}): padding is not zero")
