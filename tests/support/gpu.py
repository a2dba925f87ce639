"""The marks of the tests that launch our kernels on a CUDA device (they also need CuPy)."""

from __future__ import annotations

import pytest
import torch

__all__ = ["CUDA_KERNEL_MARKS", "needs_cupy"]


@pytest.fixture
def needs_cupy() -> None:
    """Used through CUDA_KERNEL_MARKS: a module using those marks needs this fixture in reach
    (tests/gpu/conftest.py imports it; a benchmark module imports it itself)."""
    pytest.importorskip(
        "cupy", reason='CUDA kernels launch through CuPy (pip install -e ".[cuda12]")'
    )


CUDA_KERNEL_MARKS = (
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("needs_cupy"),
)
