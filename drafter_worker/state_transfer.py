"""A joiner's state from a live rank: model, optimizer, scheduler, RNG and the trained-jobs witness,
broadcast over the new membership's process group. Never pickle.

A backend gives its whole training state as nested dicts of tensors and plain values
(``live_state()``; the witness as an int64 tensor of job ids) and takes it back
(``load_live_state()``). The source flattens it the way a checkpoint's ``state.json`` does
(:mod:`drafter_worker.state_io`): the structure and each tensor's dtype and shape go as JSON
bytes, the tensors' bytes as one flat uint8 stream broadcast in buckets of ``BUCKET_BYTES``. Every
other rank rebuilds the tensors from it. The header carries the state's step and a CRC32 of the
weights, which a receiver recomputes after loading (:func:`weights_checksum`) before it takes part
in any step.
"""

from __future__ import annotations

import json
import zlib
from array import array
from typing import Callable

import torch

from common.run.witness import TrainedJobs
from drafter_worker.state_io import flatten_state, unflatten_state

BUCKET_BYTES = 64 << 20  # one broadcast moves at most this much: bounded staging memory on every rank

Broadcast = Callable[[torch.Tensor], None]  # in place, from the source rank to every rank of the group


class StateTransferFailed(RuntimeError):
    """What arrived does not match what the source said it sent."""


def witness_tensor(trained: TrainedJobs) -> torch.Tensor:
    """The witness's job ids as an int64 tensor (ids stay below 2**63)."""
    ids = array("q", trained)
    return torch.frombuffer(bytearray(ids.tobytes()), dtype=torch.int64) if len(ids) else torch.zeros(0, dtype=torch.int64)


def witness_from_tensor(ids: torch.Tensor) -> TrainedJobs:
    return TrainedJobs(int(i) for i in ids.tolist())


def weights_checksum(weights: dict[str, torch.Tensor]) -> int:
    """CRC32 over the weights' bytes in name order: equal on two ranks only when bit-identical."""
    crc = 0
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous().reshape(-1)  # a 0-dim tensor has no byte view
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensor.view(torch.uint8).numpy().tobytes(), crc)
    return crc


def send_state(state: dict, *, step: int, checksum: int, broadcast: Broadcast, device: torch.device) -> int:
    """The source's side; returns the bytes sent."""
    tensors: dict[str, torch.Tensor] = {}
    structure = flatten_state(state, tensors)
    names = list(tensors)
    layout = [[name, str(tensors[name].dtype).removeprefix("torch."), list(tensors[name].shape)] for name in names]
    header = json.dumps({"structure": structure, "layout": layout, "step": step, "checksum": checksum}).encode()
    blobs = [tensors[name].reshape(-1).view(torch.uint8) for name in names]
    total = sum(b.numel() for b in blobs)
    broadcast(torch.tensor([len(header), total], dtype=torch.int64, device=device))
    broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
    flat = torch.cat(blobs) if blobs else torch.zeros(0, dtype=torch.uint8)
    for start in range(0, total, BUCKET_BYTES):
        broadcast(flat[start:start + BUCKET_BYTES].to(device))
    return total + len(header)


def receive_state(*, broadcast: Broadcast, device: torch.device) -> tuple[dict, int, int]:
    """Every other rank's side: (state, step, checksum the source computed)."""
    sizes = torch.zeros(2, dtype=torch.int64, device=device)
    broadcast(sizes)
    header_len, total = (int(v) for v in sizes.tolist())
    header_bytes = torch.zeros(header_len, dtype=torch.uint8, device=device)
    broadcast(header_bytes)
    header = json.loads(bytes(header_bytes.cpu().numpy().tobytes()).decode())
    flat = torch.empty(total, dtype=torch.uint8)
    for start in range(0, total, BUCKET_BYTES):
        bucket = torch.empty(min(BUCKET_BYTES, total - start), dtype=torch.uint8, device=device)
        broadcast(bucket)
        flat[start:start + bucket.numel()] = bucket.cpu()
    tensors, offset = {}, 0
    for name, dtype, shape in header["layout"]:
        dtype = getattr(torch, dtype)
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        tensors[name] = flat[offset:offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    if offset != total:
        raise StateTransferFailed(f"the state's layout covers {offset} bytes of the {total} sent")
    return unflatten_state(header["structure"], tensors), header["step"], header["checksum"]
