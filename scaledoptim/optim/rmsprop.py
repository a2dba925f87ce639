"""RMSprop: the class, the kernel's arguments (cuda/rmsprop.cu) and the torch form, once."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim.rmsprop import rmsprop as torch_rmsprop

from ..fused import FusedOptimizer
from ..fused.lowbit import (
    SIGNED,
    UNSIGNED,
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
from .spec import Config, OptimizerSpec, Tolerance

__all__ = [
    "RMSPROP_KERNEL", "RMSPROP_LOWBIT_KERNEL", "LowBitRmspropArgs", "RMSprop", "RmspropArgs",
    "RmspropOptions", "rmsprop_args",
]


@dataclasses.dataclass(frozen=True)
class RmspropOptions:
    """RMSprop's hyper-parameters (checked in torch.optim.RMSprop's order): defaults, valid
    ranges, the tests' sweep."""

    lr: float = option(
        1e-2, check="learning rate", tensor=True, sweep=(1e-2,), draw=(1e-4, 1e-1)
    )
    eps: float = option(1e-8, check="epsilon value", tensor=True, draw=(1e-10, 1e-3))
    momentum: float = option(
        0.0, check="momentum value", tensor=True, sweep=(0.0, 0.9)
    )
    weight_decay: float = option(
        0.0, check="weight_decay value", tensor=True, sweep=(0.0, 0.1)
    )
    alpha: float = option(0.99, check="alpha value", tensor=True, draw=(0.5, 0.999))
    centered: bool = option(False, sweep=(False, True))
    maximize: bool = option(False, sweep=(False, True))


# ------------------------------------------------------------------------------ the kernel
class RmspropArgs(ctypes.Structure):
    """Mirror of ``RmspropArgs`` in cuda/rmsprop.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("alpha", ctypes.c_float),
        ("one_minus_alpha", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("centered", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


RMSPROP_KERNEL = MultiTensorKernel(
    CUDA_SOURCE_DIR / "rmsprop.cu",
    "rmsprop_kernel",
    ("params", "grads", "square_avgs", "momentum_buffers", "grad_avgs", *ROUNDING_LISTS, "steps"),
    RmspropArgs,
    dtype_lists=(0, 1),
)


class LowBitRmspropArgs(ctypes.Structure):
    """Mirror of ``LowBitRmspropArgs`` in cuda/rmsprop.cu: :class:`RmspropArgs` and the block
    size."""

    _fields_ = lowbit_fields(RmspropArgs)


#: The kernel of RMSprop's 8-bit states (``state_bits=8``; Note [low-bit variants]).
RMSPROP_LOWBIT_KERNEL = lowbit_kernel(
    RMSPROP_KERNEL, ("square_avgs", "momentum_buffers", "grad_avgs"), LowBitRmspropArgs
)


def rmsprop_args(found_inf: int | None, inv_scale: int | None, o: RmspropOptions) -> RmspropArgs:
    """The kernel's arguments: device scalar pointers, and a group's options."""
    return RmspropArgs(
        found_inf=found_inf, inv_scale=inv_scale, one_minus_alpha=1 - o.alpha, **vars(o)
    )


# ------------------------------------------------------------------------------ the optimizer
class RMSprop(FusedOptimizer):
    r"""RMSprop with the loss-scaling protocol, a drop-in for :class:`torch.optim.RMSprop`.

    Same signature, same math, same state names (``step``, ``square_avg``, ``momentum_buffer``,
    ``grad_avg``). Fused and sync-free; ``foreach`` and ``capturable`` do not change the fused
    path. Every hyper-parameter may be a one-element tensor (a CPU one is read at each step).
    Complex params, views with gaps, ``differentiable=True`` and hyper-parameter tensors on an
    accelerator take :func:`torch.optim.rmsprop.rmsprop` with the group's flags, in the same
    step (the migration guide, "What takes torch.optim's own implementation"). State is fp32
    whatever the param dtype.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        alpha: smoothing constant of the squared-gradient average.
        eps: term added to the denominator for numerical stability.
        weight_decay: weight decay (L2 penalty).
        momentum: momentum factor.
        centered: normalize by the estimated variance of the gradient instead of its second
            moment.
        capturable: torch.optim's ``capturable`` flag, with its checks; the fused path does
            not depend on it (see above).
        foreach: torch.optim's ``foreach`` flag, with its checks; the fused path does not
            depend on it (see above).
        differentiable: torch.optim's ``differentiable`` flag: ``True`` takes
            :func:`torch.optim.rmsprop.rmsprop` (see above).
        maximize: maximize the objective instead of minimizing.
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
        state_bits: 32 (float32 states) or 8 (8-bit block-wise codes of ``square_avg`` and
            ``momentum_buffer``: the low-bit states guide). ``centered=True`` keeps float32
            states: its denominator ``sqrt(square_avg - grad_avg**2)`` subtracts two averages
            that 8-bit codes round apart by up to 1/16 of each, more than a small variance, so
            the difference can turn negative (a NaN step).
        block_size: elements per block of 8-bit states, each with its float32 scale.

    Example::

        >>> opt = scaledoptim.RMSprop(model.parameters(), lr=1e-2, momentum=0.9, centered=True)
        >>> _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
    """

    kernel = RMSPROP_KERNEL
    rounds = True
    options = RmspropOptions
    args = staticmethod(rmsprop_args)
    lowbit_kernel = RMSPROP_LOWBIT_KERNEL
    #: The precision of its states with ``state_bits=8`` (Note [low-bit variants]).
    lowbit_codes = MappingProxyType(
        {"square_avg": UNSIGNED, "momentum_buffer": SIGNED, "grad_avg": SIGNED}
    )
    elementwise = True
    torch_form_in_place = True
    torch_optim = torch.optim.RMSprop
    _legacy_options: ClassVar[dict[str, Any]] = {
        "momentum": 0, "centered": False, "foreach": None, "maximize": False,
        "differentiable": False, "capturable": False,
    }

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum: float = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
    ) -> None:
        defaults = dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
            centered=centered, capturable=capturable, foreach=foreach, maximize=maximize,
            differentiable=differentiable, master_weights=master_weights,
            stochastic_rounding=stochastic_rounding,
            **_lowbit_options(state_bits, block_size),
        )
        super().__init__(params, defaults)

    def check_options(self, options: dict[str, Any]) -> None:
        super().check_options(options)
        if options.get("state_bits") == 8 and options["centered"]:
            raise ValueError(
                "centered=True keeps float32 states: sqrt(square_avg - grad_avg**2) subtracts "
                "two averages 8-bit codes round apart by more than a small variance (a NaN step); "
                "use state_bits=32 with centered=True"
            )

    def check_torch_optim(self, group: dict[str, Any], params: list[Tensor]) -> None:
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise RuntimeError(
                "RMSprop does not support sparse gradients; use a dense layer "
                "(e.g. nn.Embedding(sparse=False))"
            )

    def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return (
            "square_avg",
            "momentum_buffer" if read_options(RmspropOptions, group).momentum > 0 else None,
            "grad_avg" if group["centered"] else None,
        )

    def torch_form_(self, group: dict[str, Any], tensor_lists: list[list[Tensor]]) -> None:
        """torch.optim.RMSprop's foreach math, in place and taken unconditionally: the
        torch-native backend skips it, on the host on a CPU, else on working copies."""
        params, grads, square_avgs, buffers, grad_avgs, _ = tensor_lists
        o = read_options(RmspropOptions, group)
        _rmsprop_(params, grads, square_avgs, buffers, grad_avgs, o)

    def torch_optim_update(
        self, group: dict[str, Any], tensor_lists: list[list[Tensor]], found_inf: Tensor | None
    ) -> None:
        """:func:`torch.optim.rmsprop.rmsprop`, called as ``torch.optim.RMSprop.step`` calls it
        (it takes no ``found_inf``: the route skips it on the host)."""
        params, grads, square_avgs, buffers, grad_avgs, steps = tensor_lists
        torch_rmsprop(
            params, grads, square_avgs, grad_avgs, buffers, steps, foreach=group["foreach"],
            maximize=group["maximize"], differentiable=group["differentiable"],
            capturable=group["capturable"], has_complex=any(map(torch.is_complex, params)),
            lr=group["lr"], alpha=group["alpha"], eps=group["eps"],
            weight_decay=group["weight_decay"], momentum=group["momentum"],
            centered=group["centered"],
        )


def _rmsprop_grads(grads: list[Tensor], params: list[Tensor], o: RmspropOptions) -> list[Tensor]:
    """The grads the update reads: negated if ``maximize``, plus the L2 term (new lists: the
    grads are the user's)."""
    if o.maximize:
        grads = list(torch._foreach_neg(grads))
    if o.weight_decay != 0:
        grads = list(torch._foreach_add(grads, params, alpha=o.weight_decay))
    return grads


def _rmsprop_denominators(
    square_avgs: list[Tensor], grad_avgs: list[Tensor], eps: float | Tensor
) -> list[Tensor]:
    """``sqrt(v - g_avg**2) + eps`` with ``grad_avgs`` (centered), else ``sqrt(v) + eps``, from
    the new averages: one new list."""
    if grad_avgs:
        avg = list(torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1))
        torch._foreach_sqrt_(avg)
    else:
        avg = list(torch._foreach_sqrt(square_avgs))
    if isinstance(eps, Tensor):  # alpha= takes the Tensor overload, not the Scalar's .item()
        torch._foreach_add_(avg, eps, alpha=1)
    else:
        torch._foreach_add_(avg, eps)
    return avg


def _rmsprop_(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    buffers: list[Tensor],
    grad_avgs: list[Tensor],
    o: RmspropOptions,
) -> None:
    """RMSprop's torch form, the only one: the update in place, taken unconditionally (0-dim
    tensors on a CPU for the Python scalars that torch's CPU foreach ops would wrap per tensor,
    the same value rounded once either way); two temporary lists, the grads the update reads
    (with ``maximize`` or weight decay) and the denominators."""
    alpha, eps, momentum = scalars(params, o.alpha, o.eps, o.momentum)
    grads = _rmsprop_grads(grads, params, o)
    torch._foreach_mul_(square_avgs, alpha)
    torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - o.alpha)  # a Scalar
    if o.centered:
        torch._foreach_lerp_(grad_avgs, grads, 1 - o.alpha)
    avg = _rmsprop_denominators(square_avgs, grad_avgs, eps)
    if o.momentum > 0:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_addcdiv_(buffers, grads, avg)
        torch._foreach_add_(params, buffers, alpha=-o.lr)
    else:
        torch._foreach_addcdiv_(params, grads, avg, value=-o.lr)


OptimizerSpec(
    cls=RMSprop,
    summary="a drop-in for torch.optim.RMSprop; 8-bit states available",
    reference=torch.optim.RMSprop,
    # torch's own configs (its optim_db), at a learning rate that moves params.
    configs=(
        Config("default", dict(lr=1e-2)),
        Config("weight_decay", dict(lr=1e-2, weight_decay=0.1)),
        Config("maximize", dict(lr=1e-2, maximize=True)),
        Config("centered-wd", dict(lr=1e-2, weight_decay=0.1, centered=True)),
        Config("maximize-wd", dict(lr=1e-2, weight_decay=0.1, maximize=True)),
        Config(
            "momentum-centered-wd", dict(lr=1e-2, weight_decay=0.1, centered=True, momentum=0.1)
        ),
        Config(
            "every-option",
            dict(
                lr=1e-2, alpha=0.9, eps=1e-6, weight_decay=0.1, centered=True, momentum=0.1,
                maximize=True,
            ),
        ),
    ),
    # torch's CPU sqrt of a float32 tensor is off by one ulp in ~17% of elements (our kernels'
    # sqrtf is correctly rounded, as CUDA's), and RMSprop divides by it: an ulp or two in every
    # update, amplified where a momentum buffer cancels or a grad is near zero.
    tolerance=Tolerance(param_rtol=1e-5, state_rtol=1e-5, state_atol=1e-5, trajectory_atol=1e-6),
)
