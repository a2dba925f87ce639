"""The binding of cuda/adam.cu: its argument struct, the kernel, and ``adam_``."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

from torch import Tensor

from .rounding import ROUNDING_LISTS, rounding_lists
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel
from .update import launch_update

__all__ = ["ADAM", "AdamArgs", "adam_", "adam_args"]


class AdamArgs(ctypes.Structure):
    """Mirror of ``AdamArgs`` in cuda/adam.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("log_beta1", ctypes.c_float),
        ("log_beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("param_decay", ctypes.c_float),
        ("amsgrad", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


ADAM = MultiTensorKernel(
    CUDA_SOURCE_DIR / "adam.cu",
    "adam_kernel",
    ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", *ROUNDING_LISTS, "steps"),
    AdamArgs,
    dtype_lists=(0, 1),
    per_tensor_lists=(6, 7),
)


def adam_args(
    found_inf: int | None,
    inv_scale: int | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
) -> AdamArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return AdamArgs(
        found_inf=found_inf,
        inv_scale=inv_scale,
        lr=lr,
        beta2=beta2,
        one_minus_beta1=1 - beta1,
        one_minus_beta2=1 - beta2,
        log_beta1=math.log(beta1) if beta1 > 0 else -math.inf,
        log_beta2=math.log(beta2) if beta2 > 0 else -math.inf,
        eps=eps,
        weight_decay=0.0 if decoupled_weight_decay else weight_decay,
        param_decay=1 - lr * weight_decay if decoupled_weight_decay else 1.0,
        amsgrad=amsgrad,
        maximize=maximize,
    )


def adam_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    master_params: Sequence[Tensor] = (),
    sr_seeds: Sequence[Tensor] = (),
    **options: float | bool,
) -> None:
    r"""One fused Adam (``decoupled_weight_decay=False``) or AdamW step over all tensors.

    The math of ``torch.optim.Adam``/``AdamW`` with ``foreach=False``, in fp32 whatever the
    param (fp32/fp16/bf16, may differ per tensor) and grad dtypes; params are rounded once.
    If ``found_inf`` is given and non-zero, nothing is modified. Otherwise each grad is
    multiplied by ``inv_scale`` in registers (grad memory is not written), negated if
    ``maximize``, and each ``steps[i]`` (0-dim float32 tensor counting taken steps) is advanced by
    one; bias corrections use the advanced value.

    Args:
        params, grads, exp_avgs, exp_avg_sqs, steps: one tensor per parameter; state is float32.
        max_exp_avg_sqs: one per parameter with ``amsgrad``, else an empty list.
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
        master_params, sr_seeds: the param rounding lists (see
            :func:`scaledoptim.kernels.rounding.rounding_lists`), empty to round to nearest.
        options: the keyword arguments of :func:`adam_args` (``lr``, ``beta1``, ``beta2``,
            ``eps``, ``weight_decay``, ``decoupled_weight_decay``, ``amsgrad``, ``maximize``).
    """
    if options["amsgrad"] and len(max_exp_avg_sqs) != len(params):
        raise ValueError("adam_ with amsgrad=True needs one max_exp_avg_sq per param")
    lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if options["amsgrad"] else [],
             *rounding_lists(master_params, sr_seeds), steps]  # fmt: skip
    launch_update(ADAM, lists, found_inf, inv_scale, lambda f, i: adam_args(f, i, **options))
