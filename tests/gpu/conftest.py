"""The GPU tests need CuPy as well as a CUDA device (tests.support.gpu.CUDA_KERNEL_MARKS)."""

from __future__ import annotations

from tests.support.gpu import needs_cupy  # noqa: F401 (the fixture CUDA_KERNEL_MARKS uses)
