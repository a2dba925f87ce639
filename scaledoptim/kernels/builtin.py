"""The kernels of cuda/ and the ctypes mirrors of their argument structs."""

from __future__ import annotations

import ctypes

from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

__all__ = [
    "ADAM",
    "ADVANCE_STEPS",
    "BUILTIN_KERNELS",
    "NON_FINITE_CHECK",
    "SGD",
    "UNSCALE",
    "AdamArgs",
    "AdvanceStepsArgs",
    "NonFiniteCheckArgs",
    "SgdArgs",
    "UnscaleArgs",
]

_float, _int, _ptr = ctypes.c_float, ctypes.c_int, ctypes.c_void_p


class NonFiniteCheckArgs(ctypes.Structure):
    """Mirror of ``NonFiniteCheckArgs`` in cuda/non_finite_check.cu."""

    _fields_ = [("found_inf", _ptr)]


class UnscaleArgs(ctypes.Structure):
    """Mirror of ``UnscaleArgs`` in cuda/unscale.cu."""

    _fields_ = [("found_inf", _ptr), ("inv_scale", _ptr)]


class AdvanceStepsArgs(ctypes.Structure):
    """Mirror of ``AdvanceStepsArgs`` in cuda/advance_steps.cu."""

    _fields_ = [("found_inf", _ptr)]


class AdamArgs(ctypes.Structure):
    """Mirror of ``AdamArgs`` in cuda/adam.cu."""

    _fields_ = [
        ("found_inf", _ptr),
        ("inv_scale", _ptr),
        ("lr", _float),
        ("beta2", _float),
        ("one_minus_beta1", _float),
        ("one_minus_beta2", _float),
        ("log_beta1", _float),
        ("log_beta2", _float),
        ("eps", _float),
        ("weight_decay", _float),
        ("param_decay", _float),
        ("amsgrad", _int),
        ("maximize", _int),
    ]


class SgdArgs(ctypes.Structure):
    """Mirror of ``SgdArgs`` in cuda/sgd.cu."""

    _fields_ = [
        ("found_inf", _ptr),
        ("inv_scale", _ptr),
        ("lr", _float),
        ("momentum", _float),
        ("one_minus_dampening", _float),
        ("weight_decay", _float),
        ("nesterov", _int),
        ("maximize", _int),
    ]


NON_FINITE_CHECK = MultiTensorKernel(
    CUDA_SOURCE_DIR / "non_finite_check.cu",
    "non_finite_check_kernel",
    ("tensors",),
    NonFiniteCheckArgs,
    dtype_lists=(0,),
)
UNSCALE = MultiTensorKernel(
    CUDA_SOURCE_DIR / "unscale.cu",
    "unscale_kernel",
    ("tensors",),
    UnscaleArgs,
    dtype_lists=(0,),
)
ADVANCE_STEPS = MultiTensorKernel(
    CUDA_SOURCE_DIR / "advance_steps.cu",
    "advance_steps_kernel",
    ("steps",),
    AdvanceStepsArgs,
)
ADAM = MultiTensorKernel(
    CUDA_SOURCE_DIR / "adam.cu",
    "adam_kernel",
    ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"),
    AdamArgs,
    dtype_lists=(0, 1),
    per_tensor_lists=(5,),
)
SGD = MultiTensorKernel(
    CUDA_SOURCE_DIR / "sgd.cu",
    "sgd_kernel",
    ("params", "grads", "momentum_buffers", "steps"),
    SgdArgs,
    dtype_lists=(0, 1),
    per_tensor_lists=(3,),
)

BUILTIN_KERNELS = (NON_FINITE_CHECK, UNSCALE, ADVANCE_STEPS, ADAM, SGD)
