"""Fused multi-tensor kernels (cuda/) for CUDA tensors, and their CPU emulator.

CuPy is imported only when a CUDA tensor is launched on, so this package imports and its CPU
emulator works without CuPy or a GPU. See docs/kernels.md for writing a kernel.
"""

from __future__ import annotations

from .adam import ADAM, AdamArgs, adam_, adam_args
from .builtin import (
    NON_FINITE_CHECK,
    STEP_EPILOGUE,
    NonFiniteCheckArgs,
    StepEpilogueArgs,
    non_finite_check_,
)
from .config import LaunchConfig, launch_config
from .launcher import PreparedLaunch, launch, prepare_launch
from .nvrtc import KernelCompileError
from .sgd import SGD, SgdArgs, sgd_, sgd_args
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

#: Every kernel of cuda/ that scaledoptim launches (the NVRTC check compiles each).
BUILTIN_KERNELS = (NON_FINITE_CHECK, STEP_EPILOGUE, ADAM, SGD)

__all__ = [
    "ADAM",
    "BUILTIN_KERNELS",
    "CUDA_SOURCE_DIR",
    "NON_FINITE_CHECK",
    "SGD",
    "STEP_EPILOGUE",
    "AdamArgs",
    "KernelCompileError",
    "LaunchConfig",
    "MultiTensorKernel",
    "NonFiniteCheckArgs",
    "PreparedLaunch",
    "SgdArgs",
    "StepEpilogueArgs",
    "adam_",
    "adam_args",
    "launch",
    "launch_config",
    "non_finite_check_",
    "prepare_launch",
    "sgd_",
    "sgd_args",
]
