"""The binding of cuda/lion.cu: its argument struct, the kernel, and ``lion_``."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch import Tensor

from .rounding import ROUNDING_LISTS, rounding_lists
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel
from .update import launch_update

__all__ = ["LION", "LionArgs", "lion_", "lion_args"]


class LionArgs(ctypes.Structure):
    """Mirror of ``LionArgs`` in cuda/lion.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("param_decay", ctypes.c_float),
        ("maximize", ctypes.c_int),
    ]


LION = MultiTensorKernel(
    CUDA_SOURCE_DIR / "lion.cu",
    "lion_kernel",
    ("params", "grads", "exp_avgs", *ROUNDING_LISTS, "steps"),
    LionArgs,
    dtype_lists=(0, 1),
    per_tensor_lists=(4, 5),
)


def lion_args(
    found_inf: int | None,
    inv_scale: int | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
) -> LionArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return LionArgs(
        found_inf=found_inf,
        inv_scale=inv_scale,
        lr=lr,
        beta1=beta1,
        one_minus_beta1=1 - beta1,
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        param_decay=1 - lr * weight_decay,
        maximize=maximize,
    )


def lion_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    master_params: Sequence[Tensor] = (),
    sr_seeds: Sequence[Tensor] = (),
    **options: float | bool,
) -> None:
    r"""One fused Lion step over all tensors, in fp32 whatever the param and grad dtypes.

    ``c = beta1 * m + (1 - beta1) * g``; ``p = p * (1 - lr * weight_decay) - lr * sign(c)``;
    ``m = beta2 * m + (1 - beta2) * g`` (``g`` unscaled by ``inv_scale`` in registers, negated
    if ``maximize``). If ``found_inf`` is given and non-zero, nothing is modified; otherwise each
    ``steps[i]`` advances by one.

    Args:
        params, grads, exp_avgs, steps: one tensor per parameter; exp_avgs float32, steps 0-dim
            float32 counters of taken steps.
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
        master_params, sr_seeds: the param rounding lists (see
            :func:`scaledoptim.kernels.rounding.rounding_lists`), empty to round to nearest.
        options: the keyword arguments of :func:`lion_args` (``lr``, ``beta1``, ``beta2``,
            ``weight_decay``, ``maximize``).
    """
    lists = [params, grads, exp_avgs, *rounding_lists(master_params, sr_seeds), steps]
    launch_update(LION, lists, found_inf, inv_scale, lambda f, i: lion_args(f, i, **options))
