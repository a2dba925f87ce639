"""Fused multi-tensor kernels (cuda/) for CUDA tensors, and their CPU emulator.

CuPy is imported only when a CUDA tensor is launched on, so this package imports and its CPU
emulator works without CuPy or a GPU. See docs/kernels.md for writing a kernel.
"""

from __future__ import annotations

from .builtin import (
    ADAM,
    ADVANCE_STEPS,
    BUILTIN_KERNELS,
    NON_FINITE_CHECK,
    SGD,
    UNSCALE,
    AdamArgs,
    AdvanceStepsArgs,
    NonFiniteCheckArgs,
    SgdArgs,
    UnscaleArgs,
)
from .config import LaunchConfig, launch_config
from .emulator import emulation_requested
from .launcher import launch
from .nvrtc import KernelCompileError
from .ops import adam_, non_finite_check_, sgd_, unscale_
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

__all__ = [
    "ADAM",
    "ADVANCE_STEPS",
    "BUILTIN_KERNELS",
    "CUDA_SOURCE_DIR",
    "NON_FINITE_CHECK",
    "SGD",
    "UNSCALE",
    "AdamArgs",
    "AdvanceStepsArgs",
    "KernelCompileError",
    "LaunchConfig",
    "MultiTensorKernel",
    "NonFiniteCheckArgs",
    "SgdArgs",
    "UnscaleArgs",
    "adam_",
    "emulation_requested",
    "launch",
    "launch_config",
    "non_finite_check_",
    "sgd_",
    "unscale_",
]
