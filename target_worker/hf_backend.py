"""The real target backend: a Hugging Face forward per job, its captured layers written into a slot.

Every job runs at its bucket's fixed shape ``[tokens_per_batch // seq_len, seq_len]``: the batch is
padded with filler rows to that many sequences and every sequence is right-padded to ``seq_len``,
so a bucket's tensors have the same shape every time (what fixed-shape kernels and CUDA graphs
replay) and every slot holds the same byte count. Right padding under a causal mask leaves each
real token's states exactly as if the sequence ran alone; only real sequences go into the slot.

Slot content, as the sim target writes it and :func:`common.slots.copy_out` reads it: rows
``batch_size × seq_len`` (``batch_size`` = the job's real sequences), hidden states zeroed at
padding, ``input_ids`` 0 at padding, ``loss_mask``, ``seq_lens``; the header with the generation
last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from common.capture_contract import CaptureContract, check_same_contract, contract_from_config
from common.config import Config
from common.slots import DTYPES, SlotHeader, SlotView
from target_worker.capture import LayerCapture, contract_shape_of, drop_unused_modules, load_target_model


class SampleSource(Protocol):
    """Anything that yields tokenized samples by index (the prepared dataset, an in-memory list)."""

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of sample ``index``, both 1-D and of the sample's length."""
        ...


@dataclass
class PaddedBatch:
    """One job at its bucket's fixed shape; rows past ``num_seqs`` are filler."""

    input_ids: torch.Tensor       # [rows, seq_len] int64, 0 at padding
    attention_mask: torch.Tensor  # [rows, seq_len] int64, 1 on real tokens (and on filler rows)
    loss_mask: torch.Tensor       # [num_seqs, seq_len] uint8
    seq_lens: torch.Tensor        # [num_seqs] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]


def pad_job(job: dict[str, Any], dataset: SampleSource, *, tokens_per_batch: int) -> PaddedBatch:
    """The job's samples right-padded to ``seq_len``, plus filler rows up to the bucket's batch size."""
    seq_len = int(job["seq_len"])
    samples, lengths = list(job["samples"]), list(job["lengths"])
    rows = tokens_per_batch // seq_len
    if not samples or len(samples) != len(lengths) or len(samples) > rows:
        raise ValueError(f"job {job['job_id']}: {len(samples)} samples with {len(lengths)} lengths do not form "
                         f"a batch of 1..{rows} sequences of {seq_len} tokens")
    input_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
    # Filler rows attend to their own (pad) tokens: a row with nothing to attend to would make NaNs.
    attention_mask = torch.ones(rows, seq_len, dtype=torch.int64)
    loss_mask = torch.zeros(len(samples), seq_len, dtype=torch.uint8)
    for row, (index, length) in enumerate(zip(samples, lengths)):
        ids, mask = dataset.sample(int(index))
        if len(ids) != length or len(mask) != length:
            raise ValueError(f"job {job['job_id']}: sample {index} has {len(ids)} tokens and a loss mask of "
                             f"{len(mask)} but the schedule says {length}: the dataset is not the one scheduled")
        if not 0 < length <= seq_len:
            raise ValueError(f"job {job['job_id']}: sample {index} of {length} tokens does not fit seq_len {seq_len}")
        input_ids[row, :length] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        attention_mask[row, length:] = 0
        loss_mask[row, :length] = torch.from_numpy(np.asarray(mask).astype(np.uint8))
    return PaddedBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       seq_lens=torch.tensor(lengths, dtype=torch.int32))


def default_device(config: Config) -> torch.device:
    """The first of ``target.gpus``, or the CPU (``target.dtype=auto`` then resolves to float32)."""
    return torch.device("cuda", config.target.gpus[0]) if config.target.gpus else torch.device("cpu")


class HFTargetBackend:
    """Loads ``target.model`` once; :meth:`extract` fills one slot per job."""

    def __init__(self, config: Config, *, device: str | torch.device, dataset: SampleSource,
                 keep_full_model: bool = False):
        """``keep_full_model`` keeps the layers past the last captured one and the LM head (the benchmark
        runs the plain forward too); a worker frees them (on an 8B target, about 2 GB of GPU memory)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.dataset = dataset
        self.tokens_per_batch = config.schedule.tokens_per_batch
        declared = contract_from_config(config)
        self.model = load_target_model(config.target.model, dtype=DTYPES[declared.dtype],
                                       attn_implementation=config.target.attn_implementation, device=device)
        architecture, num_layers, hidden_size = contract_shape_of(self.model)
        loaded = CaptureContract(architecture=architecture, num_layers=num_layers, hidden_size=hidden_size,
                                 layer_ids=declared.layer_ids, dtype=str(self.model.dtype).removeprefix("torch."),
                                 final_norm=declared.final_norm)
        check_same_contract(declared, loaded, ours_name="config.json", theirs_name="loaded model")
        self.contract: dict[str, Any] = declared.to_dict()
        self.capture = LayerCapture(self.model, declared.layer_ids, max_tokens=self.tokens_per_batch,
                                    final_norm=declared.final_norm)
        if not keep_full_model:
            drop_unused_modules(self.model, last_layer=self.capture.last_layer)

    def forward(self, batch: PaddedBatch) -> torch.Tensor:
        """``[rows, seq_len, K × hidden]`` for the whole fixed-shape batch (a view reused by the next call)."""
        return self.capture(batch.input_ids.to(self.device, non_blocking=True),
                            batch.attention_mask.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def extract(self, job: dict[str, Any], slot: SlotView) -> None:
        """Run the forward for one job and fill the slot (data + header, generation last)."""
        layout = slot.layout
        if layout.row_width != self.capture.row_width or layout.torch_dtype != self.capture.dtype:
            raise ValueError(f"slot rows hold {layout.row_width} {layout.dtype} values but this target captures "
                             f"{self.capture.row_width} {self.capture.dtype}: the pool was sized for another contract")
        batch = pad_job(job, self.dataset, tokens_per_batch=self.tokens_per_batch)
        num_seqs, seq_len = batch.num_seqs, batch.seq_len
        rows = num_seqs * seq_len
        if num_seqs > layout.max_seqs or rows > layout.tokens_per_batch:
            raise ValueError(f"job {job['job_id']}: {num_seqs} × {seq_len} does not fit a slot of "
                             f"{layout.tokens_per_batch} tokens / {layout.max_seqs} sequences")
        hs = self.forward(batch)[:num_seqs]
        # Padding positions hold whatever the model made of pad tokens: zero them, so a slot's content
        # depends only on its samples.
        padding = batch.attention_mask[:num_seqs].to(self.device, non_blocking=True) == 0
        hs.masked_fill_(padding.unsqueeze(-1), 0)
        slot.begin_write()
        slot.hs[:rows].copy_(hs.reshape(rows, -1), non_blocking=True)
        slot.input_ids[:rows].copy_(batch.input_ids[:num_seqs].reshape(-1))
        slot.loss_mask[:rows].copy_(batch.loss_mask.reshape(-1))
        slot.seq_lens[:num_seqs].copy_(batch.seq_lens)
        if self.device.type == "cuda" and slot.device.type == "cpu":
            # The header is a host store: it must not become visible before the async copy has landed.
            torch.cuda.current_stream(self.device).synchronize()
        slot.write_header(SlotHeader(generation=int(job["generation"]), job_id=int(job["job_id"]),
                                     bucket=int(job["bucket"]), batch_size=num_seqs, seq_len=seq_len,
                                     num_tokens=int(batch.seq_lens.sum())))

    def close(self) -> None:
        self.capture.close()
