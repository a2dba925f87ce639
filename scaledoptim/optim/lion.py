"""Lion: the class, the kernel's arguments (cuda/lion.cu) and the torch form, once."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from ..fused import FusedOptimizer
from ..fused.lowbit import (
    SIGNED,
    lowbit_fields,
    lowbit_kernel,
)
from ..fused.lowbit import lowbit_options as _lowbit_options
from ..fused.options import option, read_options
from ..kernels import (
    CUDA_SOURCE_DIR,
    ROUNDING_LISTS,
    MultiTensorKernel,
)
from ..torch_ops import scalars
from .spec import Config, OptimizerSpec

__all__ = [
    "LION_KERNEL", "LION_LOWBIT_KERNEL", "Lion", "LionArgs", "LionOptions", "LowBitLionArgs",
    "lion_args",
]


@dataclasses.dataclass(frozen=True)
class LionOptions:
    """Lion's hyper-parameters: defaults, valid ranges, the tests' sweep."""

    lr: float = option(1e-4, check="learning rate", sweep=(1e-2,), draw=(1e-4, 1e-1))
    betas: tuple[float, float] = option(
        (0.9, 0.99), check="beta parameter", high=1.0, draw=((0.0, 0.99), (0.9, 0.999))
    )
    weight_decay: float = option(0.0, check="weight_decay value", sweep=(0.0, 0.5))
    maximize: bool = option(False, sweep=(False, True))


# ------------------------------------------------------------------------------ the kernel
class LionArgs(ctypes.Structure):
    """Mirror of ``LionArgs`` in cuda/lion.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("param_decay", ctypes.c_float),
        ("maximize", ctypes.c_int),
    ]


LION_KERNEL = MultiTensorKernel(
    CUDA_SOURCE_DIR / "lion.cu",
    "lion_kernel",
    ("params", "grads", "exp_avgs", *ROUNDING_LISTS, "steps"),
    LionArgs,
    dtype_lists=(0, 1),
)


class LowBitLionArgs(ctypes.Structure):
    """Mirror of ``LowBitLionArgs`` in cuda/lion.cu: :class:`LionArgs` and the block size."""

    _fields_ = lowbit_fields(LionArgs)


#: The kernel of Lion's 8-bit state (``state_bits=8``; Note [low-bit variants]).
LION_LOWBIT_KERNEL = lowbit_kernel(LION_KERNEL, ("exp_avgs",), LowBitLionArgs)


def lion_args(found_inf: int | None, inv_scale: int | None, o: LionOptions) -> LionArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return LionArgs(
        found_inf=found_inf,
        inv_scale=inv_scale,
        lr=o.lr,
        one_minus_beta1=1 - o.betas[0],
        one_minus_beta2=1 - o.betas[1],
        param_decay=1 - o.lr * o.weight_decay,
        maximize=o.maximize,
    )


# ------------------------------------------------------------------------------ the optimizer
class Lion(FusedOptimizer):
    r"""Lion (Chen et al., 2023) with the loss-scaling protocol, fused and sync-free.

    Each step: ``c = beta1 * m + (1 - beta1) * g``;
    ``p = p * (1 - lr * weight_decay) - lr * sign(c)`` (``sign(0) = 0``);
    ``m = beta2 * m + (1 - beta2) * g``, both interpolations computed as
    ``torch.lerp(m, g, 1 - beta)`` (the bits of ``pytorch-optimizer``'s foreach Lion).
    State: ``exp_avg`` (fp32 whatever the param dtype) and ``step``; with ``state_bits=8``,
    ``exp_avg_codes`` and ``exp_avg_scales`` (8-bit block-wise codes: the low-bit states
    guide). Lion's update reads only the sign of its interpolation, so its momentum suits 8 bits
    well.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate (Lion's updates have unit magnitude per element: use 3-10x less than
            AdamW's).
        betas: the interpolation factor of the update (``beta1``) and the momentum decay
            (``beta2``).
        weight_decay: decoupled weight decay coefficient.
        maximize: maximize the objective instead of minimizing.
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
        state_bits: 32 (float32 states) or 8 (8-bit block-wise codes of every state).
        block_size: elements per block of 8-bit states, each with its float32 scale.

    Example::

        >>> opt = scaledoptim.Lion(model.parameters(), lr=1e-4, weight_decay=1.0)
        >>> _, found_inf, S = opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    """

    kernel = LION_KERNEL
    rounds = True
    options = LionOptions
    args = staticmethod(lion_args)
    lowbit_kernel = LION_LOWBIT_KERNEL
    #: The precision of its state with ``state_bits=8`` (Note [low-bit variants]).
    lowbit_codes = MappingProxyType({"exp_avg": SIGNED})
    elementwise = True
    torch_form_in_place = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
            **_lowbit_options(state_bits, block_size),
        )
        super().__init__(params, defaults)

    def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("exp_avg",)

    def torch_form_(self, group: dict[str, Any], tensor_lists: list[list[Tensor]]) -> None:
        """The kernel's arithmetic in place and taken unconditionally: the torch-native backend
        skips it, on the host on a CPU, else on working copies."""
        params, grads, exp_avgs, _ = tensor_lists
        _lion_(params, grads, exp_avgs, read_options(LionOptions, group))


def _lion_(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], o: LionOptions
) -> None:
    """Lion's torch form, the only one: the update in place, taken unconditionally, with the
    kernel's arithmetic (the same bits, which stochastic rounding relies on); one temporary
    list (two with ``maximize``)."""
    lr = o.lr
    (decay,) = scalars(params, 1 - lr * o.weight_decay)
    if o.maximize:
        grads = list(torch._foreach_neg(grads))
    c = torch._foreach_lerp(exp_avgs, grads, 1 - o.betas[0])
    torch._foreach_sign_(c)
    if o.weight_decay != 0:  # (times 1 is exact)
        torch._foreach_mul_(params, decay)
    torch._foreach_add_(params, c, alpha=-lr)  # sign(c) * lr is exact: fused or not, one rounding
    del c
    torch._foreach_lerp_(exp_avgs, grads, 1 - o.betas[1])


OptimizerSpec(
    cls=Lion,
    summary="Chen et al. (2023): sign updates, one momentum; an 8-bit state available",
    reference=None,
    configs=(
        Config("default", dict(lr=1e-3)),
        Config("wd-maximize", dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.5, maximize=True)),
    ),
)
