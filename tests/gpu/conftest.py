"""The device the kernel tests here run on: a CUDA device (marked ``gpu``; skipped without one, or
without CuPy) and the CPU, where the same test bodies run our kernels in the emulator, with the
small launch geometry of tests/kernels so that small tensors cross every chunk boundary."""

from __future__ import annotations

import pytest
import torch

from scaledoptim.kernels import launch_config
from tests.support.gpu import needs_cupy  # noqa: F401 (the fixture CUDA_KERNEL_MARKS uses)
from tests.support.tensors import CHUNK, EMULATOR_THREADS


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "emulated"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    if request.param == "emulated":
        monkeypatch.setattr(launch_config, "chunk_size", CHUNK)
        monkeypatch.setattr(launch_config, "emulator_threads_per_block", EMULATOR_THREADS)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    request.getfixturevalue("needs_cupy")
    return torch.device("cuda")
