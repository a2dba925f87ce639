"""The binding of cuda/sgd.cu: its argument struct, the kernel, and ``sgd_``."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch import Tensor

from .rounding import ROUNDING_LISTS, rounding_lists
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel
from .update import launch_update

__all__ = ["SGD", "SgdArgs", "sgd_", "sgd_args"]


class SgdArgs(ctypes.Structure):
    """Mirror of ``SgdArgs`` in cuda/sgd.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("one_minus_dampening", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("nesterov", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


SGD = MultiTensorKernel(
    CUDA_SOURCE_DIR / "sgd.cu",
    "sgd_kernel",
    ("params", "grads", "momentum_buffers", *ROUNDING_LISTS, "steps"),
    SgdArgs,
    dtype_lists=(0, 1),
    per_tensor_lists=(4, 5),
)


def sgd_args(
    found_inf: int | None,
    inv_scale: int | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
) -> SgdArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return SgdArgs(
        found_inf=found_inf,
        inv_scale=inv_scale,
        lr=lr,
        momentum=momentum,
        one_minus_dampening=1 - dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
    )


def sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    master_params: Sequence[Tensor] = (),
    sr_seeds: Sequence[Tensor] = (),
    **options: float | bool,
) -> None:
    r"""One fused SGD step over all tensors (``torch.optim.SGD``, ``foreach=False`` math).

    fp32 math; params fp32/fp16/bf16 rounded once; grads fp32/fp16/bf16; buffers float32.
    If ``found_inf`` is given and non-zero, nothing is modified. Otherwise grads are unscaled in
    registers by ``inv_scale`` and ``steps[i]`` advances by one. On a parameter's first taken
    step (``steps[i] == 0`` before it) the momentum buffer is set to the gradient, as torch does
    when it creates the buffer, so buffers may start with any content.

    Args:
        momentum_buffers: one float32 tensor per param, or an empty list when ``momentum == 0``.
        steps: one 0-dim float32 tensor per param, counting taken steps.
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
        master_params, sr_seeds: the param rounding lists (see
            :func:`scaledoptim.kernels.rounding.rounding_lists`), empty to round to nearest.
        options: the keyword arguments of :func:`sgd_args` (``lr``, ``momentum``,
            ``dampening``, ``nesterov``, ``weight_decay``, ``maximize``).
    """
    if options["momentum"] != 0 and len(momentum_buffers) != len(params):
        raise ValueError("sgd_ with momentum != 0 needs one momentum buffer per param")
    lists = [params, grads, momentum_buffers if options["momentum"] != 0 else [],
             *rounding_lists(master_params, sr_seeds), steps]  # fmt: skip
    launch_update(SGD, lists, found_inf, inv_scale, lambda f, i: sgd_args(f, i, **options))
