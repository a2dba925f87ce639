"""The binding of cuda/adagrad.cu: its argument struct, the kernel, and ``adagrad_``."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch import Tensor

from .rounding import ROUNDING_LISTS, rounding_lists
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel
from .update import launch_update

__all__ = ["ADAGRAD", "AdagradArgs", "adagrad_", "adagrad_args"]


class AdagradArgs(ctypes.Structure):
    """Mirror of ``AdagradArgs`` in cuda/adagrad.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("lr_decay", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("maximize", ctypes.c_int),
    ]


ADAGRAD = MultiTensorKernel(
    CUDA_SOURCE_DIR / "adagrad.cu",
    "adagrad_kernel",
    ("params", "grads", "state_sums", *ROUNDING_LISTS, "steps"),
    AdagradArgs,
    dtype_lists=(0, 1),
    per_tensor_lists=(4, 5),
)


def adagrad_args(
    found_inf: int | None,
    inv_scale: int | None,
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
) -> AdagradArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return AdagradArgs(found_inf, inv_scale, lr, lr_decay, weight_decay, eps, maximize)


def adagrad_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state_sums: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    master_params: Sequence[Tensor] = (),
    sr_seeds: Sequence[Tensor] = (),
    **options: float | bool,
) -> None:
    r"""One fused Adagrad step over all tensors (``torch.optim.Adagrad``, ``foreach=False`` math).

    fp32 math whatever the param and grad dtypes; ``state_sums`` float32. If ``found_inf`` is
    given and non-zero, nothing is modified; otherwise grads are unscaled in registers and each
    ``steps[i]`` advances by one (the learning-rate decay uses the advanced value).

    Args:
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
        master_params, sr_seeds: the param rounding lists (see
            :func:`scaledoptim.kernels.rounding.rounding_lists`), empty to round to nearest.
        options: the keyword arguments of :func:`adagrad_args` (``lr``, ``lr_decay``,
            ``weight_decay``, ``eps``, ``maximize``).
    """
    lists = [params, grads, state_sums, *rounding_lists(master_params, sr_seeds), steps]
    launch_update(ADAGRAD, lists, found_inf, inv_scale, lambda f, i: adagrad_args(f, i, **options))
