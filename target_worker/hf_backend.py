"""The real target backend: a Hugging Face forward per job, its captured layers written into a slot.

A job runs at its own shape ``[num_seqs, seq_len]``: every sequence right-padded to the job's
``seq_len`` (the batch's longest sample under ``schedule.batching=sorted``, the bucket's max length
under ``fixed``). Right padding under a causal mask leaves each real token's states exactly as if
the sequence ran alone.

Slot content, as the sim target writes it and :func:`common.dataplane.slots.copy_out` reads it: rows
``batch_size × seq_len``, hidden states zeroed at padding, ``input_ids`` 0 at padding,
``loss_mask``, ``seq_lens``; the header with the generation last.

Under tensor parallelism (``target.tp_size`` > 1) the backend is one rank of a
:class:`target_worker.tp_group.TargetGroup`: rank 0's :meth:`HFTargetBackend.extract` shares the
job's tokens with the group before its forward; the other ranks run :meth:`HFTargetBackend.follow`.

On a GPU the slot is written from a side stream while the next job's forward runs: the capture
alternates between two output buffers, each with its copy stream, and :meth:`HFTargetBackend.extract`
returns the write in flight (:class:`SideStreamWrite`); the worker loop waits for it, and so
publishes the header and reports the job ready, only after it has queued the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from common import faults
from common.run.capture_contract import CaptureContract, check_same_contract, contract_of
from common.run.config import Objective, ScheduleSection, TargetSection
from common.run.prepared import DataError
from common.run.target_model import find_decoder
from common.dataplane.slots import DTYPES, SlotHeader, SlotView
from common.wire import messages
from target_worker.capture import LayerCapture, contract_shape_of, drop_unused_modules, load_target_model
from target_worker.tp_group import SharedBatch, TargetGroup, TargetGroupLost


class SampleSource(Protocol):
    """Anything that yields tokenized samples by index (the prepared dataset, an in-memory list)."""

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of sample ``index``, both 1-D and of the sample's length."""
        ...


@dataclass
class PaddedBatch:
    """One job: its sequences right-padded to ``seq_len``."""

    input_ids: torch.Tensor       # [num_seqs, seq_len] int64, 0 at padding
    attention_mask: torch.Tensor  # [num_seqs, seq_len] int64, 1 on real tokens
    loss_mask: torch.Tensor       # [num_seqs, seq_len] uint8
    seq_lens: torch.Tensor        # [num_seqs] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]


def pad_job(job: messages.Job, dataset: SampleSource, *, tokens_per_batch: int, pin: bool = False) -> PaddedBatch:
    """The job's samples right-padded to its ``seq_len``; ``pin``: the ids and mask in page-locked
    memory (CUDA only), so their host-to-GPU copies run async instead of staging through a
    pageable bounce buffer while the host waits."""
    seq_len = job.seq_len
    samples, lengths = list(job.samples), list(job.lengths)
    if not samples or len(samples) != len(lengths) or len(samples) * seq_len > tokens_per_batch:
        raise ValueError(f"job {job.job_id}: {len(samples)} samples with {len(lengths)} lengths do not form "
                         f"a batch of 1..{tokens_per_batch // seq_len} sequences of {seq_len} tokens")
    input_ids = torch.zeros(len(samples), seq_len, dtype=torch.int64, pin_memory=pin)
    attention_mask = torch.zeros(len(samples), seq_len, dtype=torch.int64, pin_memory=pin)
    loss_mask = torch.zeros(len(samples), seq_len, dtype=torch.uint8)
    for row, (index, length) in enumerate(zip(samples, lengths)):
        try:
            ids, mask = dataset.sample(int(index))
        except IndexError as exc:
            raise DataError(f"job {job.job_id}: {exc}: the dataset is not the one scheduled") from None
        if len(ids) != length or len(mask) != length:
            raise DataError(f"job {job.job_id}: sample {index} has {len(ids)} tokens and a loss mask of "
                            f"{len(mask)} but the schedule says {length}: the dataset is not the one scheduled")
        if not 0 < length <= seq_len:
            raise ValueError(f"job {job.job_id}: sample {index} of {length} tokens does not fit seq_len {seq_len}")
        input_ids[row, :length] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.from_numpy(np.asarray(mask).astype(np.uint8))
    return PaddedBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       seq_lens=torch.tensor(lengths, dtype=torch.int32))


@dataclass
class SideStreamWrite:
    """A slot being filled on ``stream``; :meth:`wait` blocks until ``copied`` and publishes ``header``."""

    slot: SlotView
    header: SlotHeader
    stream: torch.cuda.Stream
    copied: torch.cuda.Event

    def wait(self) -> None:
        self.copied.synchronize()
        with torch.cuda.stream(self.stream):  # a GPU slot's header is written behind its data
            self.slot.write_header(self.header)


def default_device(target: TargetSection) -> torch.device:
    """The first of ``target.gpus``, or the CPU (``target.dtype=auto`` then resolves to float32)."""
    return torch.device("cuda", target.gpus[0]) if target.gpus else torch.device("cpu")


class HFTargetBackend:
    """Loads ``target.model`` once; :meth:`extract` fills one slot per job."""

    def __init__(self, target: TargetSection, schedule: ScheduleSection, *, objective: Objective,
                 device: str | torch.device, dataset: SampleSource | None, keep_full_model: bool = False,
                 group: TargetGroup | None = None):
        """``objective``: the run's ``drafter.objective`` (the capture contract's default layers and
        final-norm state follow it). ``keep_full_model`` keeps the layers past the last captured one
        and the LM head (the benchmark runs the plain forward too); a worker frees them (on an 8B
        target, about 2 GB of GPU memory). ``group``: this process's tensor-parallel group, joined
        (the model then loads sharded across it)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.dataset = dataset
        self.tokens_per_batch = schedule.tokens_per_batch
        declared = contract_of(target, objective)
        self.group = group
        self.model = load_target_model(target.model, dtype=DTYPES[declared.dtype],
                                       attn_implementation=target.attn_implementation, device=device,
                                       tp_size=group.size if group is not None else 1)
        if group is not None:
            group.loaded()
        architecture, num_layers, hidden_size = contract_shape_of(self.model)
        loaded = CaptureContract(architecture=architecture, num_layers=num_layers, hidden_size=hidden_size,
                                 layer_ids=declared.layer_ids, dtype=str(self.model.dtype).removeprefix("torch."),
                                 final_norm=declared.final_norm, capture_point=declared.capture_point)
        check_same_contract(declared, loaded, ours_name="config.json", theirs_name="loaded model")
        self.contract = declared
        on_gpu = device.type == "cuda"
        # Two capture buffers on a GPU: the next forward fills one while the other drains into its slot.
        self.capture = LayerCapture(self.model, declared.layer_ids, max_tokens=self.tokens_per_batch,
                                    num_buffers=2 if on_gpu else 1, final_norm=declared.final_norm)
        self._copy_streams = [torch.cuda.Stream(device) for _ in range(2)] if on_gpu else []
        self._copied = [torch.cuda.Event() for _ in range(2)] if on_gpu else []
        if group is not None and group.rank > 0 and faults.target_rank_fault_armed(group.rank):
            decoder, layers_name = find_decoder(self.model)
            layer = decoder._modules[layers_name][min(1, self.capture.last_layer)]
            layer.register_forward_pre_hook(lambda *_: group.inside_forward())
        if not keep_full_model:
            drop_unused_modules(self.model, last_layer=self.capture.last_layer)

    def forward(self, batch: PaddedBatch | SharedBatch, *, job_id: int = -1) -> torch.Tensor:
        """``[num_seqs, seq_len, K × hidden]`` (a view of a capture buffer that a later call reuses).

        In a group every rank runs it on the same batch; a rank that died or hung makes it raise
        :class:`TargetGroupLost`."""
        if self._copied:  # the buffer this call fills must have drained from its previous use
            torch.cuda.current_stream(self.device).wait_event(self._copied[self.capture.next_buffer])
        ids = batch.input_ids.to(self.device, non_blocking=True)
        mask = batch.attention_mask.to(self.device, non_blocking=True)
        if self.group is None:
            return self.capture(ids, mask)
        self.group.arm(job_id)
        try:
            hs = self.capture(ids, mask)
            if self.device.type == "cuda":  # the forward's collectives done, or failed, before it counts as run
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as exc:  # whatever failed, the ranks' collectives no longer match: the group is over
            raise TargetGroupLost(f"rank {self.group.rank}: the forward of job {job_id} failed in the group: "
                                  f"{exc}") from exc
        finally:
            self.group.disarm()
        return hs

    @torch.inference_mode()
    def follow(self, batch: SharedBatch) -> None:
        """A rank other than 0 of a group: its share of the forward of the batch rank 0 shared."""
        self.forward(batch, job_id=batch.job_id)

    @torch.inference_mode()
    def extract(self, job: messages.Job, slot: SlotView) -> SideStreamWrite | None:
        """Run the forward for one job and fill the slot: complete on return on the CPU (None); on a GPU
        the copy still in flight, whose ``wait()`` publishes the header."""
        layout = slot.layout
        if layout.row_width != self.capture.row_width or layout.torch_dtype != self.capture.dtype:
            raise ValueError(f"slot rows hold {layout.row_width} {layout.dtype} values but this target captures "
                             f"{self.capture.row_width} {self.capture.dtype}: the pool was sized for another contract")
        # Pinned on a GPU: the torch host allocator keeps each buffer until its async copy is done.
        batch = pad_job(job, self.dataset, tokens_per_batch=self.tokens_per_batch, pin=self.device.type == "cuda")
        num_seqs, seq_len = batch.num_seqs, batch.seq_len
        rows = num_seqs * seq_len
        if num_seqs > layout.max_seqs or rows > layout.tokens_per_batch:
            raise ValueError(f"job {job.job_id}: {num_seqs} × {seq_len} does not fit a slot of "
                             f"{layout.tokens_per_batch} tokens / {layout.max_seqs} sequences")
        header = SlotHeader(generation=job.generation, job_id=job.job_id, bucket=job.bucket,
                            batch_size=num_seqs, seq_len=seq_len, num_tokens=int(batch.seq_lens.sum()))
        buffer_index = self.capture.next_buffer
        if self.group is not None:
            self.group.share(job.job_id, batch.input_ids, batch.attention_mask)
        hs = self.forward(batch, job_id=job.job_id)
        if self.group is not None:
            self.group.forwarded()
        # Padding positions hold whatever the model made of pad tokens: zero them, so a slot's content
        # depends only on its samples.
        padding = batch.attention_mask.to(self.device, non_blocking=True) == 0
        hs.masked_fill_(padding.unsqueeze(-1), 0)
        rows_hs = hs.reshape(rows, -1)
        if self.device.type != "cuda":
            self._write_tokens(slot, batch)
            slot.hs[:rows].copy_(rows_hs)
            slot.write_header(header)
            return None
        compute, stream = torch.cuda.current_stream(self.device), self._copy_streams[buffer_index]
        with torch.cuda.stream(stream):
            # The token regions do not depend on the forward: queued first, so even a blocking host-to-GPU
            # copy into a cuda_ipc slot waits only for this stream, never for the forward.
            self._write_tokens(slot, batch)
            stream.wait_stream(compute)  # the hidden states are what the forward queued on the compute stream
            slot.hs[:rows].copy_(rows_hs, non_blocking=True)  # device to pinned host, or device to device
            self._copied[buffer_index].record(stream)
        return SideStreamWrite(slot=slot, header=header, stream=stream, copied=self._copied[buffer_index])

    @staticmethod
    def _write_tokens(slot: SlotView, batch: PaddedBatch) -> None:
        """Mark the slot being written, then its ids, loss mask and lengths (the hidden states follow)."""
        rows = batch.num_seqs * batch.seq_len
        slot.begin_write()
        slot.input_ids[:rows].copy_(batch.input_ids.reshape(-1))
        slot.loss_mask[:rows].copy_(batch.loss_mask.reshape(-1))
        slot.seq_lens[:batch.num_seqs].copy_(batch.seq_lens)

    def close(self) -> None:
        self.capture.close()
