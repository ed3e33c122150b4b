"""Slot layout, header protocol and the integrity pattern, on plain CPU buffers."""

from __future__ import annotations

import msgpack
import pytest
import torch

from common.run.config import Config
from common.dataplane.slot_pattern import SlotIntegrityError, fill_pattern, verify_pattern
from common.dataplane.slots import SlotHeader, SlotLayout, SlotView, StaleSlotError, copy_out

LAYOUT = SlotLayout(tokens_per_batch=1024, num_layers=3, hidden_size=40, dtype="bfloat16", max_seqs=8)


def _view(layout: SlotLayout = LAYOUT) -> SlotView:
    return SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8), layout)


def _fill(view: SlotView, *, job_id: int = 11, generation: int = 5, seq_lens=(100, 128, 7)) -> None:
    fill_pattern(view, job_id=job_id, generation=generation, bucket=128, batch_size=len(seq_lens), seq_len=128,
                 seq_lens=list(seq_lens))


@pytest.mark.parametrize("layout", [
    LAYOUT,
    SlotLayout(tokens_per_batch=8192, num_layers=5, hidden_size=64, dtype="bfloat16", max_seqs=64),
    SlotLayout(tokens_per_batch=1001, num_layers=1, hidden_size=3, dtype="float32", max_seqs=7),
    SlotLayout(tokens_per_batch=999, num_layers=2, hidden_size=5, dtype="float16", max_seqs=999),
])
def test_layout_regions_are_aligned_and_disjoint(layout: SlotLayout) -> None:
    regions = [(layout.hs_offset, layout.hs_bytes), (layout.input_ids_offset, layout.input_ids_bytes),
               (layout.loss_mask_offset, layout.loss_mask_bytes), (layout.seq_lens_offset, layout.seq_lens_bytes)]
    assert layout.header_bytes == layout.hs_offset == 256
    end = layout.header_bytes
    for offset, size in regions:
        assert offset % 64 == 0 and offset >= end
        end = offset + size
    assert layout.slot_bytes % 4096 == 0 and end <= layout.slot_bytes < end + 4096
    assert layout.hs_bytes == layout.tokens_per_batch * layout.num_layers * layout.hidden_size * \
        layout.torch_dtype.itemsize
    assert layout.input_ids_bytes == 4 * layout.tokens_per_batch and layout.seq_lens_bytes == 4 * layout.max_seqs

    view = _view(layout)
    assert view.hs.shape == (layout.tokens_per_batch, layout.num_layers * layout.hidden_size)
    assert view.hs.dtype == layout.torch_dtype
    assert view.input_ids.shape == view.loss_mask.shape == (layout.tokens_per_batch,)
    assert view.seq_lens.shape == (layout.max_seqs,)
    # Zero-copy: every view aliases the slot buffer at its offset.
    base = view.buffer.data_ptr()
    assert view.hs.data_ptr() - base == layout.hs_offset
    assert view.seq_lens.data_ptr() - base == layout.seq_lens_offset


def test_layout_from_config_and_round_trip() -> None:
    layout = SlotLayout.from_config(Config())
    assert layout == SlotLayout(tokens_per_batch=8192, num_layers=5, hidden_size=64, dtype="bfloat16", max_seqs=64)
    assert "8192 tok × 5 layers × 64 hidden × bfloat16" in layout.describe()
    assert layout.describe().startswith("slot 5.3 MB")
    wire = msgpack.unpackb(msgpack.packb(layout.to_dict()))
    assert SlotLayout.from_dict(wire) == layout
    with pytest.raises(ValueError, match="different hsdispatch versions"):
        SlotLayout.from_dict({**wire, "slot_bytes": wire["slot_bytes"] + 4096})
    with pytest.raises(ValueError, match="missing required field `dtype`"):
        SlotLayout.from_dict({k: v for k, v in wire.items() if k != "dtype"})


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"hidden_size": 0}, {"max_seqs": 2048}, {"num_layers": 2.0}])
def test_layout_rejects_bad_values(bad: dict) -> None:
    fields = {"tokens_per_batch": 1024, "num_layers": 3, "hidden_size": 40, "dtype": "bfloat16", "max_seqs": 8}
    with pytest.raises(ValueError):
        SlotLayout(**{**fields, **bad})


def test_header_protocol() -> None:
    view = _view()
    assert view.read_header().generation == 0  # never written
    header = SlotHeader(generation=(1 << 63) - 1, job_id=-3, bucket=256, batch_size=4, seq_len=256, num_tokens=900)
    view.write_header(header)
    assert view.read_header() == header
    view.begin_write()
    assert view.read_generation() == 0
    assert view.read_header().job_id == -3
    for bad in (dict(generation=0), dict(batch_size=9), dict(seq_len=1024), dict(num_tokens=1025)):
        with pytest.raises(ValueError):
            view.write_header(SlotHeader(**{**header.__dict__, **bad}))


def test_header_detects_layout_mismatch() -> None:
    view = _view()
    _fill(view)
    other = SlotLayout(tokens_per_batch=1024, num_layers=3, hidden_size=40, dtype="float16", max_seqs=8)
    with pytest.raises(ValueError, match="capture contract"):
        SlotView(view.buffer, other).read_header()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_pattern_round_trip(dtype: str) -> None:
    layout = SlotLayout(tokens_per_batch=1024, num_layers=3, hidden_size=40, dtype=dtype, max_seqs=8)
    view = _view(layout)
    _fill(view, job_id=123456789)
    batch = copy_out(view, 5, torch.device("cpu"))
    assert batch.header == SlotHeader(generation=5, job_id=123456789, bucket=128, batch_size=3, seq_len=128,
                                      num_tokens=235)
    assert batch.hs.shape == (3, 128, 120) and batch.input_ids.shape == batch.loss_mask.shape == (3, 128)
    assert batch.seq_lens.tolist() == [100, 128, 7]
    assert batch.hs.data_ptr() != view.hs.data_ptr()  # a copy, the slot can be reused
    assert torch.isfinite(batch.hs.float()).all()
    assert batch.input_ids[2, 7:].eq(0).all() and batch.loss_mask[2, 7:].eq(0).all()
    verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=123456789,
                   expected_seq_lens=[100, 128, 7])
    with pytest.raises(SlotIntegrityError, match="job 123456788"):
        verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=123456788)


def test_corrupted_byte_is_detected() -> None:
    view = _view()
    _fill(view)
    row_bytes = LAYOUT.row_width * 2
    view.buffer[LAYOUT.hs_offset + 130 * row_bytes + 17] ^= 0x01
    batch = copy_out(view, 5, torch.device("cpu"))
    with pytest.raises(SlotIntegrityError, match="hs differs first at row 130, column 8") as info:
        verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=11)
    assert info.value.job_id == 11

    _fill(view)
    view.input_ids[200] += 1
    batch = copy_out(view, 5, torch.device("cpu"))
    with pytest.raises(SlotIntegrityError, match="input_ids differ first at row 200"):
        verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=11)


def test_stale_generation_is_detected() -> None:
    view = _view()
    _fill(view, generation=5)
    with pytest.raises(StaleSlotError, match="expected generation 4, found 5 before"):
        copy_out(view, 4, torch.device("cpu"))
    view.begin_write()  # a new job is being written into the slot
    with pytest.raises(StaleSlotError, match="found 0 before"):
        copy_out(view, 5, torch.device("cpu"))


class _RewrittenDuringCopy(SlotView):
    """A slot whose writer starts on a new job right when the reader takes its views."""

    def batch(self, header: SlotHeader):
        views = super().batch(header)
        fill_pattern(self, job_id=99, generation=header.generation + 1, bucket=128, batch_size=1, seq_len=128,
                     seq_lens=[128])
        return views


def test_rewrite_during_copy_is_detected() -> None:
    view = _view()
    _fill(view, generation=5)
    with pytest.raises(StaleSlotError, match="expected generation 5, found 6 after"):
        copy_out(_RewrittenDuringCopy(view.buffer, LAYOUT), 5, torch.device("cpu"))
