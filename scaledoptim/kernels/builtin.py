"""The kernels every fused optimizer shares: the read-only inf/nan check, and the step epilogue
that advances the step counters and moves the loss scale."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from .dispatch import launch
from .launcher import chunk_count, scalar_pointer
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

__all__ = [
    "NON_FINITE_CHECK",
    "NON_FINITE_CHECK_NORM",
    "STEP_EPILOGUE",
    "ChunkPartials",
    "NonFiniteCheckArgs",
    "NonFiniteCheckNormArgs",
    "StepEpilogueArgs",
    "non_finite_check_",
]


class NonFiniteCheckArgs(ctypes.Structure):
    """Mirror of ``NonFiniteCheckArgs`` in cuda/non_finite_check.cu."""

    _fields_ = [("found_inf", ctypes.c_void_p), ("inv_scale", ctypes.c_void_p)]


class NonFiniteCheckNormArgs(ctypes.Structure):
    """Mirror of ``NonFiniteCheckNormArgs`` in cuda/non_finite_check.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("norm_sq", ctypes.c_void_p),
        ("partials", ctypes.c_void_p),
        ("arrivals", ctypes.c_void_p),
        ("n_chunks", ctypes.c_uint),
    ]


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


class ChunkPartials:
    """Scratch of a sum over the blocks of several launches (Note [deterministic sums] in
    cuda/block_sums.cuh): one partial per chunk of every tensor, in one buffer in the tensors'
    order, and the count of blocks that stored theirs (0 between launches: the last resets it)."""

    def __init__(self, chunks: int, device: torch.device) -> None:
        self.partials = torch.zeros(chunks, device=device)
        self.arrivals = torch.zeros((), dtype=torch.int32, device=device)

    def per_tensor(self, tensors: list[Tensor]) -> list[Tensor]:
        """The partials of each of ``tensors`` (those the buffer was sized for), as views."""
        return list(self.partials.split([chunk_count(t.numel()) for t in tensors]))


NON_FINITE_CHECK = MultiTensorKernel(
    CUDA_SOURCE_DIR / "non_finite_check.cu",
    "non_finite_check_kernel",
    ("tensors",),
    NonFiniteCheckArgs,
    dtype_lists=(0,),
)
#: The check, and the fp32 sum of squares of the checked values (times ``inv_scale``) into a
#: device scalar, through per-chunk partial sums (Note [deterministic sums]).
NON_FINITE_CHECK_NORM = MultiTensorKernel(
    CUDA_SOURCE_DIR / "non_finite_check.cu",
    "non_finite_check_norm_kernel",
    ("tensors", "sq_partials"),
    NonFiniteCheckNormArgs,
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
