"""A safetensors file written tensor by tensor, so an offline capture never holds more than one batch.

``safetensors.torch.save_file`` needs every tensor in memory at once; captured states of a real
target run to tens of kilobytes per token. The format allows streaming when every name, dtype and
shape is known up front (an offline capture knows them from the sample lengths): the header is
written first, each tensor then lands at its offset as it is produced, in any order.

Format: an 8-byte little-endian header length, a JSON header (padded with spaces so the data is
8-byte aligned) mapping each name to ``{dtype, shape, data_offsets}`` plus ``__metadata__``, then
the tensors' bytes back to back with no gaps.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from common.run.durable import publish

_DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                torch.int32: "I32", torch.uint8: "U8"}


class StreamingSafetensorsWriter:
    """Declare every tensor at construction, :meth:`write` each once, :meth:`close` to finish."""

    def __init__(self, path: str | Path, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 metadata: dict[str, str] | None = None):
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name, dtype, shape in specs:
            if name in header:
                raise ValueError(f"tensor {name!r} declared twice")
            if dtype not in _DTYPE_CODES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored")
            nbytes = dtype.itemsize
            for dim in shape:
                nbytes *= int(dim)
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + nbytes]}
            self._layout[name] = (dtype, tuple(int(d) for d in shape), offset)
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._data_start = 8 + len(encoded)
        self._pending = set(self._layout)
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._fd = os.open(self._tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        self._open = True
        os.ftruncate(self._fd, self._data_start + offset)
        os.pwrite(self._fd, struct.pack("<Q", len(encoded)) + encoded, 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._layout:
            raise KeyError(f"tensor {name!r} was not declared")
        dtype, shape, offset = self._layout[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {shape}")
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        written = os.pwrite(self._fd, data, self._data_start + offset)
        if written != data.nbytes:
            raise OSError(f"short write of {name!r}: {written} of {data.nbytes} bytes")
        self._pending.discard(name)

    def close(self) -> None:
        """Publish the file (atomically, under its final name) once every declared tensor is written."""
        if self._pending:
            missing = sorted(self._pending)
            self.abort()
            raise ValueError(f"{len(missing)} declared tensor(s) never written, e.g. {missing[:3]}")
        self._open = False
        os.close(self._fd)
        publish(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the partial file (idempotent)."""
        if self._open:
            self._open = False
            os.close(self._fd)
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, *_exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
