"""The streaming safetensors writer: what it writes is what the safetensors library reads."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from target_worker.safetensors_stream import StreamingSafetensorsWriter


def test_tensors_written_in_any_order_load_back(tmp_path):
    torch.manual_seed(0)
    tensors = {"a.hidden": torch.randn(7, 12).to(torch.bfloat16), "a.ids": torch.arange(7, dtype=torch.int32),
               "b.hidden": torch.randn(3, 12), "b.mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
               "empty": torch.zeros(0, 12, dtype=torch.float16)}
    path = tmp_path / "out.safetensors"
    specs = [(name, t.dtype, t.shape) for name, t in tensors.items()]
    with StreamingSafetensorsWriter(path, specs, metadata={"contract": "{}"}) as writer:
        for name in reversed(list(tensors)):
            writer.write(name, tensors[name])
        assert not path.exists()  # only a complete file appears under its name
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"contract": "{}"}


def test_wrong_or_missing_tensors_are_refused(tmp_path):
    path = tmp_path / "out.safetensors"
    writer = StreamingSafetensorsWriter(path, [("x", torch.float32, (2, 3)), ("y", torch.int32, (4,))])
    with pytest.raises(ValueError, match="declared torch.float32 \\(2, 3\\)"):
        writer.write("x", torch.zeros(3, 2))
    with pytest.raises(KeyError, match="'z' was not declared"):
        writer.write("z", torch.zeros(1))
    writer.write("x", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1 declared tensor\\(s\\) never written, e.g. \\['y'\\]"):
        writer.close()
    assert list(tmp_path.iterdir()) == []
