"""Tiny random Qwen3 targets saved to a temporary directory, shared by the DFlash tests."""

from __future__ import annotations

import pytest
import torch

from dflash_testing import load_target, make_target


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_target(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_model(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="session")
def tiny_tied_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied_target")
    make_target(path, tie=True, seed=1)
    return path
