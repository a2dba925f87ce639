"""The kernels every fused optimizer shares: the read-only inf/nan check and the step counters."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch import Tensor

from .launcher import PreparedLaunch, launch, prepare_launch, scalar_pointer
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

__all__ = [
    "ADVANCE_STEPS",
    "NON_FINITE_CHECK",
    "AdvanceStepsArgs",
    "NonFiniteCheckArgs",
    "non_finite_check_",
    "prepare_advance_steps",
]


class NonFiniteCheckArgs(ctypes.Structure):
    """Mirror of ``NonFiniteCheckArgs`` in cuda/non_finite_check.cu."""

    _fields_ = [("found_inf", ctypes.c_void_p)]


class AdvanceStepsArgs(ctypes.Structure):
    """Mirror of ``AdvanceStepsArgs`` in cuda/advance_steps.cu."""

    _fields_ = [("found_inf", ctypes.c_void_p)]


NON_FINITE_CHECK = MultiTensorKernel(
    CUDA_SOURCE_DIR / "non_finite_check.cu",
    "non_finite_check_kernel",
    ("tensors",),
    NonFiniteCheckArgs,
    dtype_lists=(0,),
)
ADVANCE_STEPS = MultiTensorKernel(
    CUDA_SOURCE_DIR / "advance_steps.cu",
    "advance_steps_kernel",
    ("steps",),
    AdvanceStepsArgs,
)


def non_finite_check_(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    r"""Sets ``found_inf`` to 1.0 if any element of ``tensors`` is inf or nan; never writes 0.

    Read-only on ``tensors`` (dense, see :func:`~scaledoptim.kernels.prepare_launch`). The
    caller zeroes ``found_inf`` first (Note [found_inf contract] in cuda/common.cuh).
    """
    if not tensors:
        return
    found = scalar_pointer(found_inf, "found_inf", tensors[0].device)
    launch(NON_FINITE_CHECK, [tensors], NonFiniteCheckArgs(found))


def prepare_advance_steps(steps: Sequence[Tensor]) -> PreparedLaunch:
    """The launch that adds 1 to every step counter unless ``found_inf`` is set (Note [step
    counters]); run it with ``AdvanceStepsArgs(found_inf_pointer)`` after the update."""
    return prepare_launch(ADVANCE_STEPS, [steps])
