"""Shared test setup: the repo root on sys.path (tests run from a checkout), deterministic seeds."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# No verdict may depend on the machine's load: Hypothesis's two timing checks (the per-example
# deadline, the too-slow data generation health check) are off for every test; a test that
# passes its own suppress_health_check list names too_slow there as well.
settings.register_profile(
    "scaledoptim", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("scaledoptim")

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
