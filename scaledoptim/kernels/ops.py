"""The fused operations the optimizers call: inf/nan check, unscale, Adam/AdamW and SGD steps.

All follow Note [found_inf contract] (cuda/common.cuh). On CUDA tensors they enqueue work on
torch's current stream and never synchronize with the host; on CPU tensors they run the same
kernels through the emulator.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .builtin import (
    ADAM,
    ADVANCE_STEPS,
    NON_FINITE_CHECK,
    SGD,
    UNSCALE,
    AdamArgs,
    AdvanceStepsArgs,
    NonFiniteCheckArgs,
    SgdArgs,
    UnscaleArgs,
)
from .launcher import launch
from .spec import MultiTensorKernel

__all__ = ["adam_", "non_finite_check_", "sgd_", "unscale_"]


def _scalar_ptr(t: Tensor | None, name: str, device: torch.device) -> int | None:
    """The data pointer of a 0-dim float32 device scalar (None passes through as null)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a 0-dim float32 tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
        raise ValueError(
            f"{name} must be a one-element float32 tensor on {device}, got {t.dtype} of "
            f"shape {tuple(t.shape)} on {t.device}"
        )
    return t.data_ptr()


def non_finite_check_(tensors: Sequence[Tensor], found_inf: Tensor) -> None:
    r"""Sets ``found_inf`` to 1.0 if any element of ``tensors`` is inf or nan; never writes 0.

    Read-only on ``tensors``. The caller zeroes ``found_inf`` first.
    """
    if not tensors:
        return
    found = _scalar_ptr(found_inf, "found_inf", tensors[0].device)
    launch(NON_FINITE_CHECK, [tensors], NonFiniteCheckArgs(found))


def unscale_(tensors: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    r"""In place ``t *= inv_scale`` for every tensor; sets ``found_inf`` to 1.0 on any inf/nan.

    Like ``torch._amp_foreach_non_finite_check_and_unscale_``: the check looks at the values
    before scaling, and ``found_inf`` is never set to 0.
    """
    if not tensors:
        return
    if inv_scale is None:
        raise TypeError("unscale_ needs inv_scale (a 0-dim float32 tensor)")
    device = tensors[0].device
    args = UnscaleArgs(
        _scalar_ptr(found_inf, "found_inf", device), _scalar_ptr(inv_scale, "inv_scale", device)
    )
    launch(UNSCALE, [tensors], args)


def _launch_update(
    kernel: MultiTensorKernel,
    tensor_lists: list[Sequence[Tensor]],
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    make_args: Callable[[int | None, int | None], ctypes.Structure],
) -> None:
    """Launches an update ``kernel`` over ``tensor_lists`` (params first, step counters last) with
    ``make_args(found_inf_ptr, inv_scale_ptr)``, then advances the counters."""
    device = tensor_lists[0][0].device
    found = _scalar_ptr(found_inf, "found_inf", device)
    launch(kernel, tensor_lists, make_args(found, _scalar_ptr(inv_scale, "inv_scale", device)))
    # Note [step counters]: after the update launches, on the same stream.
    launch(ADVANCE_STEPS, [tensor_lists[-1]], AdvanceStepsArgs(found))


def adam_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
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
        lr, beta1, beta2, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.Adam``.
        decoupled_weight_decay: ``True`` for AdamW (``p *= 1 - lr * weight_decay``), ``False``
            for Adam's L2 term (``g += weight_decay * p``).
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
    """
    if not params:
        return
    if amsgrad and len(max_exp_avg_sqs) != len(params):
        raise ValueError("adam_ with amsgrad=True needs one max_exp_avg_sq per param")
    _launch_update(
        ADAM,
        [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps],
        found_inf,
        inv_scale,
        lambda found, inv: AdamArgs(
            found_inf=found,
            inv_scale=inv,
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
        ),
    )


def sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
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
        lr, momentum, dampening, nesterov, weight_decay, maximize: as in ``torch.optim.SGD``.
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
    """
    if not params:
        return
    if momentum != 0 and len(momentum_buffers) != len(params):
        raise ValueError("sgd_ with momentum != 0 needs one momentum buffer per param")
    _launch_update(
        SGD,
        [params, grads, momentum_buffers if momentum != 0 else [], steps],
        found_inf,
        inv_scale,
        lambda found, inv: SgdArgs(
            found_inf=found,
            inv_scale=inv,
            lr=lr,
            momentum=momentum,
            one_minus_dampening=1 - dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        ),
    )
