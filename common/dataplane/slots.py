"""Slot layout and zero-copy views of one hidden-state slot.

A slot is a fixed-size byte range (in shared memory or on a GPU) that holds one batch::

    header | hs [tokens_per_batch, num_layers * hidden_size] | input_ids | loss_mask | seq_lens

Every region starts on a 64-byte boundary and a slot spans a whole number of 4 KiB pages, so slot
``i`` of a pool starts at ``i * slot_bytes`` and every typed view is aligned for its dtype.

Stale reads. The dispatcher hands out ``(slot, generation)`` and may give a slot to a new job
once a lease expires, while a slow drafter could still be copying it. A writer therefore marks
the slot "being written" (generation 0) first, fills the data, and publishes the header with the
new generation last; a reader checks the generation before and after its copy
(:meth:`SlotView.check_generation`), so a copy that overlapped a rewrite raises
:class:`StaleSlotError` instead of training on a torn batch. This relies on stores becoming
visible in program order (true on x86-64; the data copies themselves are joined before the
header store).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.run.slot_layout import (DTYPE_SIZES, HEADER_BYTES, REGION_ALIGN, SLOT_ALIGN, SlotLayout, StaleSlotError,
                                format_bytes)

_DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}

# "HSDSLOT1" read as a little-endian int64; the digit is the header version.
SLOT_MAGIC = int.from_bytes(b"HSDSLOT1", "little")

# int64 word index of each header field. Generation has its own word so it can be stored last.
_MAGIC, _GENERATION, _JOB_ID, _BUCKET, _BATCH_SIZE, _SEQ_LEN, _NUM_TOKENS = range(7)
_NUM_LAYERS, _HIDDEN_SIZE, _DTYPE_CODE, _TOKENS_PER_BATCH, _MAX_SEQS = range(7, 12)
_HEADER_WORDS = 12
_MAX_GENERATION = (1 << 63) - 1

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
assert DTYPES.keys() == DTYPE_SIZES.keys()
assert all(DTYPES[name].itemsize == size for name, size in DTYPE_SIZES.items())

__all__ = ["DTYPES", "HEADER_BYTES", "REGION_ALIGN", "SLOT_ALIGN", "SLOT_MAGIC", "SlotBatch", "SlotHeader",
           "SlotCopy", "SlotLayout", "SlotView", "StaleSlotError", "copy_out", "format_bytes", "start_copy"]


@dataclass(frozen=True)
class SlotHeader:
    """What a slot holds: the job, its generation and the used shape ``batch_size × seq_len``."""

    generation: int
    job_id: int
    bucket: int
    batch_size: int
    seq_len: int
    num_tokens: int

    @property
    def num_rows(self) -> int:
        """Token rows in use: sequences are padded to ``seq_len`` and packed back to back."""
        return self.batch_size * self.seq_len


@dataclass
class SlotBatch:
    """The used part of a slot: views into it, or a reader's own copy (see :func:`copy_out`)."""

    hs: torch.Tensor         # [batch_size, seq_len, num_layers * hidden_size]
    input_ids: torch.Tensor  # [batch_size, seq_len] int32, 0 at padding
    loss_mask: torch.Tensor  # [batch_size, seq_len] uint8
    seq_lens: torch.Tensor   # [batch_size] int32
    header: SlotHeader

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.hs, self.input_ids, self.loss_mask, self.seq_lens

    def clone(self) -> SlotBatch:
        hs, ids, mask, lens = (t.clone() for t in self._tensors())
        return SlotBatch(hs, ids, mask, lens, self.header)

    def copy_to(self, device: torch.device, *, non_blocking: bool = False) -> SlotBatch:
        # Always a copy: Tensor.to() would return the slot itself when it already is on ``device``.
        hs, ids, mask, lens = (torch.empty_like(t, device=device).copy_(t, non_blocking=non_blocking)
                               for t in self._tensors())
        return SlotBatch(hs, ids, mask, lens, self.header)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in self._tensors():
            t.record_stream(stream)


class SlotView:
    """Zero-copy typed views of one slot inside a uint8 tensor (CPU shared memory or a CUDA buffer)."""

    def __init__(self, buffer: torch.Tensor, layout: SlotLayout):
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1, "a slot view wraps a flat uint8 tensor"
        if buffer.numel() != layout.slot_bytes:
            raise ValueError(f"slot buffer has {buffer.numel()} bytes, layout needs {layout.slot_bytes}")
        self.buffer = buffer
        self.layout = layout
        self._header = buffer[:HEADER_BYTES].view(torch.int64)
        self.hs = buffer[layout.hs_offset:layout.hs_offset + layout.hs_bytes].view(layout.torch_dtype).view(
            layout.tokens_per_batch, layout.row_width)
        self.input_ids = buffer[layout.input_ids_offset:layout.input_ids_offset + layout.input_ids_bytes].view(torch.int32)
        self.loss_mask = buffer[layout.loss_mask_offset:layout.loss_mask_offset + layout.loss_mask_bytes]
        self.seq_lens = buffer[layout.seq_lens_offset:layout.seq_lens_offset + layout.seq_lens_bytes].view(torch.int32)
        self._write_started: float | None = None
        # The host's seconds from begin_write to the header's publication, of the latest write: a
        # writer that fills the slot between the two (a CPU target) times its copy by it.
        self.write_s: float | None = None

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def begin_write(self) -> None:
        """Mark the slot as being written, so a reader still holding the old generation fails its check."""
        self._write_started, self.write_s = time.perf_counter(), None
        self._header[_GENERATION].fill_(0)

    def write_header(self, header: SlotHeader) -> None:
        """Publish the slot: every field first, the generation last (call after the data is written)."""
        layout = self.layout
        if not 0 < header.generation <= _MAX_GENERATION:
            raise ValueError(f"generation must be in [1, 2**63), got {header.generation}")
        if not 0 < header.batch_size <= layout.max_seqs:
            raise ValueError(f"batch_size {header.batch_size} is outside [1, {layout.max_seqs}]")
        if header.seq_len <= 0 or header.num_rows > layout.tokens_per_batch:
            raise ValueError(f"{header.batch_size} × {header.seq_len} rows exceed the slot's "
                             f"{layout.tokens_per_batch} tokens")
        if not 0 <= header.num_tokens <= header.num_rows:
            raise ValueError(f"num_tokens {header.num_tokens} exceeds the {header.num_rows} padded rows")
        words = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
        words[:_HEADER_WORDS] = torch.tensor([
            SLOT_MAGIC, 0, header.job_id, header.bucket, header.batch_size, header.seq_len, header.num_tokens,
            layout.num_layers, layout.hidden_size, _DTYPE_CODES[layout.dtype], layout.tokens_per_batch,
            layout.max_seqs], dtype=torch.int64)
        # Generation 0 is copied with the rest; the real one is stored alone afterwards.
        self._header.copy_(words)
        self._header[_GENERATION].fill_(header.generation)
        if self._write_started is not None:
            self.write_s, self._write_started = time.perf_counter() - self._write_started, None

    def read_generation(self) -> int:
        """The published generation; 0 while being written or never written."""
        return int(self._header[_GENERATION].item())

    def read_header(self) -> SlotHeader:
        words = self._header[:_HEADER_WORDS].cpu().tolist()
        if words[_MAGIC] != SLOT_MAGIC:
            return SlotHeader(generation=0, job_id=-1, bucket=0, batch_size=0, seq_len=0, num_tokens=0)
        echo = (words[_NUM_LAYERS], words[_HIDDEN_SIZE], _DTYPE_NAMES.get(words[_DTYPE_CODE]),
                words[_TOKENS_PER_BATCH], words[_MAX_SEQS])
        layout = self.layout
        expected = (layout.num_layers, layout.hidden_size, layout.dtype, layout.tokens_per_batch, layout.max_seqs)
        if echo != expected:
            raise ValueError(f"slot was written with layout (layers, hidden, dtype, tokens, max_seqs)={echo} but is "
                             f"read with {expected}: target and drafter disagree on the capture contract")
        return SlotHeader(generation=words[_GENERATION], job_id=words[_JOB_ID], bucket=words[_BUCKET],
                          batch_size=words[_BATCH_SIZE], seq_len=words[_SEQ_LEN], num_tokens=words[_NUM_TOKENS])

    def batch(self, header: SlotHeader) -> SlotBatch:
        """Zero-copy views of the rows ``header`` says are in use."""
        batch_size, seq_len, rows = header.batch_size, header.seq_len, header.num_rows
        return SlotBatch(hs=self.hs[:rows].view(batch_size, seq_len, self.layout.row_width),
                         input_ids=self.input_ids[:rows].view(batch_size, seq_len),
                         loss_mask=self.loss_mask[:rows].view(batch_size, seq_len),
                         seq_lens=self.seq_lens[:batch_size], header=header)

    def expect_generation(self, generation: int, *, when: str = "before") -> SlotHeader:
        """The header, if it still carries ``generation``; :class:`StaleSlotError` otherwise."""
        header = self.read_header()
        if header.generation != generation:
            raise StaleSlotError(generation, header.generation, when)
        return header


class SlotCopy:
    """A slot's used part on its way to a reader's device: the batch, and the event that completes it.

    On the CPU the copy is done when this is made (``event`` is None). On a CUDA device the copies
    are queued on a copy stream and ``event`` is recorded after them: the micro-batch the caller
    queued before keeps computing meanwhile. :meth:`wait` is the one way to take the batch: it
    waits for this copy alone (never for the compute stream), checks the slot's generation again
    (a writer that started during the copy raises :class:`StaleSlotError`), and makes the caller's
    current stream wait for the copy on the device before any kernel of its own reads the batch.
    """

    def __init__(self, view: SlotView, generation: int, batch: SlotBatch, *, device: torch.device,
                 stream: torch.cuda.Stream | None = None, event: torch.cuda.Event | None = None,
                 checked: bool = False):
        self.view = view
        self.device = device
        self.generation = generation
        self._batch = batch
        self.stream = stream
        self.event = event
        self.checked = checked  # the generation was checked after the read already (a remote read)

    def wait(self) -> SlotBatch:
        if self.event is None:
            return self._batch
        self.event.synchronize()  # this copy only: compute queued on other streams runs on
        if not self.checked:
            with torch.cuda.stream(self.stream):  # a header on a GPU (cuda_ipc) is read on the copy stream too
                self.view.expect_generation(self.generation, when="after")
        consumer = torch.cuda.current_stream(self.device)
        if self.stream != consumer:
            consumer.wait_event(self.event)
            # Allocated on the copy stream: not to be reused until the consumer's work on it is done.
            self._batch.record_stream(consumer)
        return self._batch


def start_copy(view: SlotView, generation: int, device: torch.device, *,
               stream: torch.cuda.Stream | None = None, into: SlotView | None = None) -> SlotCopy:
    """Begin copying the used part of a slot to ``device``, if it holds ``generation`` (else StaleSlotError).

    On the CPU, ``into`` is a staging slot of the reader's own: the batch is then views into it,
    valid until the next read, and no fresh pages are faulted in per read (on a VM that costs more
    than the copy itself). The copy and both generation checks are done on return.

    On a CUDA device the copies (and the tiny header read) run on ``stream`` so they do not queue
    behind the caller's compute stream: from pinned pages for a shm slot, device to device for a
    cuda_ipc one. The returned :class:`SlotCopy` carries the event recorded after them.
    """
    if device.type == "cpu":
        if view.device.type != "cpu":
            raise ValueError(f"cannot read a {view.device} slot into CPU memory: use a CUDA device")
        header = view.expect_generation(generation, when="before")
        if into is None:
            out = view.batch(header).clone()
        else:
            out = into.batch(header)
            for dst, src in zip(out._tensors(), view.batch(header)._tensors()):
                dst.copy_(src)
        view.expect_generation(generation, when="after")
        return SlotCopy(view, generation, out, device=device)
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        header = view.expect_generation(generation, when="before")
        out = view.batch(header).copy_to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return SlotCopy(view, generation, out, device=device, stream=stream, event=event)


def copy_out(view: SlotView, generation: int, device: torch.device, *,
             stream: torch.cuda.Stream | None = None, into: SlotView | None = None) -> SlotBatch:
    """:func:`start_copy`, waited for: the batch, ready for the caller's current stream."""
    return start_copy(view, generation, device, stream=stream, into=into).wait()
