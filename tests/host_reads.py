"""Counting the places where Python code reads a tensor's values back to the host.

On a GPU each of these waits for every kernel queued before it (a device-to-host copy and a
synchronisation); on the CPU they cost nothing, so a CPU test can only find them by looking at the
calls. :class:`HostReads` is a ``TorchFunctionMode``: every torch function and tensor method called
from Python inside it passes through it, and it records the ones that hand a value to the host or
take a shape from the data: ``item``, ``tolist``, ``cpu``, ``numpy``, the conversions to Python
numbers and truth values, ``nonzero``-like calls, and indexing with a boolean mask.

A copy with ``.to("cpu")`` cannot be told apart from moving an input to the CPU device the test
trains on, so it is not counted: the code under test must use ``.cpu()`` (counted) to read.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_READ_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                 "__complex__", "__array__", "__format__", "is_nonzero", "equal", "allclose"}
# Their result's size depends on the data: a GPU must finish computing it before the host can allocate it.
_DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}


def _is_mask(index) -> bool:
    if isinstance(index, tuple):
        return any(_is_mask(i) for i in index)
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads:`` ... ``reads.names`` lists what read the host, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READ_METHODS or name in _DATA_SHAPED:
            self.names.append(name)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _is_mask(args[1]):
            self.names.append(f"{name}[mask]")
        elif name == "where" and len(args) + len(kwargs) == 1:  # torch.where(cond) is nonzero
            self.names.append("where(cond)")
        elif name == "repeat_interleave" and isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else None),
                                                        torch.Tensor):
            self.names.append("repeat_interleave(tensor)")
        return func(*args, **kwargs)
