"""Shared test setup: the repo root on sys.path (tests run from a checkout), deterministic seeds."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["torch-native", "emulated-kernels"])
def kernel_backend(request, monkeypatch) -> str:
    """Runs a test on both update paths of the fused optimizers: torch's fused ops, and our CUDA
    kernels executed by the CPU emulator (``SCALEDOPTIM_KERNELS=emulate``)."""
    if request.param == "emulated-kernels":
        monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    else:
        monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    return request.param
