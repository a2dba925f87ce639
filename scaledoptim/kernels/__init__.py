"""Fused multi-tensor kernels (cuda/) for CUDA tensors, and their CPU emulator.

CuPy is imported only when a CUDA tensor is launched on, so this package imports and its CPU
emulator works without CuPy or a GPU. See docs/kernels.md for writing a kernel.
"""

from __future__ import annotations

from .adagrad import ADAGRAD, AdagradArgs, adagrad_, adagrad_args
from .adam import ADAM, AdamArgs, adam_, adam_args
from .builtin import (
    NON_FINITE_CHECK,
    STEP_EPILOGUE,
    NonFiniteCheckArgs,
    StepEpilogueArgs,
    non_finite_check_,
)
from .config import LaunchConfig, launch_config
from .lamb import LAMB, LAMB_GRAD_NORM, LAMB_NORMS, LambArgs, LambNormArgs, lamb_, lamb_args
from .launcher import PreparedLaunch, launch, prepare_launch
from .library import launch_op
from .lion import LION, LionArgs, lion_, lion_args
from .nvrtc import KernelCompileError
from .rounding import ROUNDING_LISTS, rounding_lists
from .sgd import SGD, SgdArgs, sgd_, sgd_args
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

#: Every kernel of cuda/ that scaledoptim launches (the NVRTC check compiles each).
BUILTIN_KERNELS = (
    NON_FINITE_CHECK,
    STEP_EPILOGUE,
    ADAM,
    SGD,
    LION,
    ADAGRAD,
    LAMB_GRAD_NORM,
    LAMB_NORMS,
    LAMB,
)

__all__ = [
    "ADAGRAD",
    "ADAM",
    "BUILTIN_KERNELS",
    "CUDA_SOURCE_DIR",
    "LAMB",
    "LAMB_GRAD_NORM",
    "LAMB_NORMS",
    "LION",
    "NON_FINITE_CHECK",
    "ROUNDING_LISTS",
    "SGD",
    "STEP_EPILOGUE",
    "AdagradArgs",
    "AdamArgs",
    "KernelCompileError",
    "LambArgs",
    "LambNormArgs",
    "LaunchConfig",
    "LionArgs",
    "MultiTensorKernel",
    "NonFiniteCheckArgs",
    "PreparedLaunch",
    "SgdArgs",
    "StepEpilogueArgs",
    "adagrad_",
    "adagrad_args",
    "adam_",
    "adam_args",
    "lamb_",
    "lamb_args",
    "launch",
    "launch_op",
    "launch_config",
    "lion_",
    "lion_args",
    "non_finite_check_",
    "prepare_launch",
    "rounding_lists",
    "sgd_",
    "sgd_args",
]
