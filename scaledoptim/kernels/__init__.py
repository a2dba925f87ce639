"""Fused multi-tensor kernels (cuda/) for CUDA tensors, and their CPU emulator; this package
knows no optimizer.

CuPy is imported only when a CUDA tensor is launched on, so this package imports and its CPU
emulator works without CuPy or a GPU. See docs/kernels.md for writing a kernel; each
optimizer's kernel is defined in its own file of ``scaledoptim/optim/``.
"""

from __future__ import annotations

from typing import Any

from .builtin import (
    NON_FINITE_CHECK,
    NON_FINITE_CHECK_NORM,
    STEP_EPILOGUE,
    ChunkPartials,
    NonFiniteCheckArgs,
    NonFiniteCheckNormArgs,
    StepEpilogueArgs,
    non_finite_check_,
)
from .config import MAX_THREADS_PER_BLOCK, LaunchConfig, launch_config
from .dispatch import launch
from .launcher import (
    PLAIN_TENSOR_TYPES,
    PreparedLaunch,
    chunk_count,
    is_dense,
    prepare_launch,
    scalar_pointer,
)
from .nvrtc import KernelCompileError
from .rounding import ROUNDING_LISTS, rounding_lists
from .sources import CUDA_SOURCE_DIR
from .spec import CUDA_TYPE_NAMES, PER_TENSOR_NAMES, MultiTensorKernel, registered_kernels

__all__ = [
    "CUDA_SOURCE_DIR",
    "CUDA_TYPE_NAMES",
    "MAX_THREADS_PER_BLOCK",
    "NON_FINITE_CHECK",
    "NON_FINITE_CHECK_NORM",
    "PER_TENSOR_NAMES",
    "PLAIN_TENSOR_TYPES",
    "ROUNDING_LISTS",
    "STEP_EPILOGUE",
    "ChunkPartials",
    "KernelCompileError",
    "LaunchConfig",
    "MultiTensorKernel",
    "NonFiniteCheckArgs",
    "NonFiniteCheckNormArgs",
    "PreparedLaunch",
    "StepEpilogueArgs",
    "builtin_kernels",
    "chunk_count",
    "is_dense",
    "launch",
    "launch_config",
    "launch_op",
    "non_finite_check_",
    "prepare_launch",
    "registered_kernels",
    "rounding_lists",
    "scalar_pointer",
]


def builtin_kernels() -> tuple[MultiTensorKernel, ...]:
    """scaledoptim's own kernels (those whose source is a file of its ``cuda/``) defined so far:
    every one of them once ``scaledoptim`` is imported."""
    own = CUDA_SOURCE_DIR.resolve()
    return tuple(
        k for k in registered_kernels() if k.source.resolve().parent == own and k.source.is_file()
    )


def __getattr__(name: str) -> Any:
    # The launch op lives in library.py, which imports torch._dynamo: only when asked for.
    if name == "launch_op":
        from .library import launch_op

        return launch_op
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
