"""The kernels every fused optimizer shares: the read-only inf/nan check, and the step epilogue
that advances the step counters and moves the loss scale."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch import Tensor

from .dispatch import launch
from .launcher import scalar_pointer
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

__all__ = [
    "NON_FINITE_CHECK",
    "STEP_EPILOGUE",
    "NonFiniteCheckArgs",
    "StepEpilogueArgs",
    "non_finite_check_",
]


class NonFiniteCheckArgs(ctypes.Structure):
    """Mirror of ``NonFiniteCheckArgs`` in cuda/non_finite_check.cu."""

    _fields_ = [("found_inf", ctypes.c_void_p), ("inv_scale", ctypes.c_void_p)]


class StepEpilogueArgs(ctypes.Structure):
    """Mirror of ``StepEpilogueArgs`` in cuda/step_epilogue.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("scale_found_inf", ctypes.c_void_p),
        ("scaled_by", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("growth_tracker", ctypes.c_void_p),
        ("hysteresis_tracker", ctypes.c_void_p),
        ("growth_factor", ctypes.c_double),
        ("backoff_factor", ctypes.c_double),
        ("min_scale", ctypes.c_float),
        ("max_scale", ctypes.c_float),
        ("growth_interval", ctypes.c_int64),
        ("hysteresis", ctypes.c_int),
        ("force_backoff", ctypes.c_int),
    ]


NON_FINITE_CHECK = MultiTensorKernel(
    CUDA_SOURCE_DIR / "non_finite_check.cu",
    "non_finite_check_kernel",
    ("tensors",),
    NonFiniteCheckArgs,
    dtype_lists=(0,),
)
STEP_EPILOGUE = MultiTensorKernel(
    CUDA_SOURCE_DIR / "step_epilogue.cu",
    "step_epilogue_kernel",
    ("steps",),
    StepEpilogueArgs,
)


def non_finite_check_(
    tensors: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor | None = None
) -> None:
    r"""Sets ``found_inf`` to 1.0 if any element of ``tensors`` times ``inv_scale`` (``None``:
    as it is) is inf or nan; never writes 0.

    The product is the unscaled grad an update kernel computes in registers: at a scale below 1
    a finite scaled grad can unscale to inf. Read-only on ``tensors`` (dense, see
    :func:`~scaledoptim.kernels.prepare_launch`). The caller zeroes ``found_inf`` first (Note
    [found_inf contract] in cuda/common.cuh).
    """
    if not tensors:
        return
    device = tensors[0].device
    launch(
        NON_FINITE_CHECK,
        [tensors],
        NonFiniteCheckArgs(
            scalar_pointer(found_inf, "found_inf", device),
            scalar_pointer(inv_scale, "inv_scale", device),
        ),
    )
