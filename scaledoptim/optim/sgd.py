"""SGD: the class, the kernel's arguments (cuda/sgd.cu) and the torch form."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, ClassVar, cast

import torch
from torch import Tensor
from torch.optim.sgd import sgd as torch_sgd

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
from ..torch_ops import advance_steps_
from .spec import Config, ErrorInput, OptimizerSpec

__all__ = [
    "SGD", "SGD_KERNEL", "SGD_LOWBIT_KERNEL", "LowBitSgdArgs", "SgdArgs", "SgdOptions", "sgd_args",
]


@dataclasses.dataclass(frozen=True)
class SgdOptions:
    """SGD's hyper-parameters: defaults, valid ranges, the tests' sweep."""

    lr: float = option(
        1e-3, check="learning rate", tensor=True, sweep=(0.05,), draw=(1e-4, 1.0)
    )
    momentum: float = option(0.0, check="momentum value", tensor=True, sweep=(0.0, 0.9))
    dampening: float = option(0.0, tensor=True, sweep=(0.0, 0.3))
    weight_decay: float = option(
        0.0, check="weight_decay value", tensor=True, sweep=(0.0, 0.1)
    )
    nesterov: bool = option(False, sweep=(False, True))
    maximize: bool = option(False, sweep=(False, True))


# ------------------------------------------------------------------------------ the kernel
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


SGD_KERNEL = MultiTensorKernel(
    CUDA_SOURCE_DIR / "sgd.cu",
    "sgd_kernel",
    ("params", "grads", "momentum_buffers", *ROUNDING_LISTS, "steps"),
    SgdArgs,
    dtype_lists=(0, 1),
)


class LowBitSgdArgs(ctypes.Structure):
    """Mirror of ``LowBitSgdArgs`` in cuda/sgd.cu: :class:`SgdArgs` and the block size."""

    _fields_ = lowbit_fields(SgdArgs)


#: The kernel of SGD's 8-bit momentum (``state_bits=8``; Note [low-bit variants]).
SGD_LOWBIT_KERNEL = lowbit_kernel(SGD_KERNEL, ("momentum_buffers",), LowBitSgdArgs)


def sgd_args(found_inf: int | None, inv_scale: int | None, o: SgdOptions) -> SgdArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return SgdArgs(
        found_inf=found_inf,
        inv_scale=inv_scale,
        lr=o.lr,
        momentum=o.momentum,
        one_minus_dampening=1 - o.dampening,
        weight_decay=o.weight_decay,
        nesterov=o.nesterov,
        maximize=o.maximize,
    )


# ------------------------------------------------------------------------------ the optimizer
class SGD(FusedOptimizer):
    r"""SGD (momentum, dampening, Nesterov) with the loss-scaling protocol, a drop-in for
    :class:`torch.optim.SGD`.

    Same signature, same math, same state name (``momentum_buffer``), plus a ``step`` counter of
    taken steps kept on device, so that a skipped first step does not count as the step that
    initialises the momentum buffer. ``lr`` and ``weight_decay`` may be one-element tensors (CPU
    ones are read at each step). ``foreach`` and ``fused`` do not change the fused path. Complex
    params, sparse grads, views with gaps, ``differentiable=True`` and hyper-parameter tensors
    on an accelerator take :func:`torch.optim.sgd.sgd` with the group's flags, in the same step
    (the migration guide, "What takes torch.optim's own implementation").

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: weight decay (L2 penalty).
        nesterov: enables Nesterov momentum.
        maximize: maximize the objective instead of minimizing.
        foreach: torch.optim's ``foreach`` flag, with its checks; the fused path does not
            depend on it (see above).
        fused: torch.optim's ``fused`` flag, with its checks; the fused path does not
            depend on it (see above).
        differentiable: torch.optim's ``differentiable`` flag: ``True`` takes
            :func:`torch.optim.sgd.sgd` (see above).
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
        state_bits: 32 (a float32 momentum buffer) or 8 (8-bit block-wise codes of it:
            ``momentum_buffer_codes`` and ``momentum_buffer_scales``, the low-bit states guide).
        block_size: elements per block of 8-bit states, each with its float32 scale.
    """

    kernel = SGD_KERNEL
    rounds = True
    options = SgdOptions
    args = staticmethod(sgd_args)
    lowbit_kernel = SGD_LOWBIT_KERNEL
    #: The precision of its state with ``state_bits=8`` (Note [low-bit variants]).
    lowbit_codes = MappingProxyType({"momentum_buffer": SIGNED})
    elementwise = True
    torch_update_takes_grad_scale = True
    torch_optim = torch.optim.SGD
    _legacy_options: ClassVar[dict[str, Any]] = {
        "nesterov": False,
        "maximize": False,
        "foreach": None,
        "differentiable": False,
        "fused": False,
    }
    _state_may_lack_step = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
            **_lowbit_options(state_bits, block_size),
        )
        super().__init__(params, defaults)

    def check_options(self, options: dict[str, Any]) -> None:
        super().check_options(options)
        o = read_options(SgdOptions, options)
        if o.nesterov and (o.momentum <= 0 or o.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def check_torch_optim(self, group: dict[str, Any], params: list[Tensor]) -> None:
        if group["weight_decay"] != 0 and any(
            p.grad is not None and p.grad.is_sparse for p in params
        ):
            raise RuntimeError(
                "SGD's weight_decay is not compatible with sparse gradients (torch.optim.SGD "
                "raises 'add(sparse, dense) is not supported'); pass weight_decay=0 for params "
                "with sparse grads (a param group of their own), or use a dense layer "
                "(nn.Embedding(sparse=False))"
            )

    def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("momentum_buffer" if read_options(SgdOptions, group).momentum != 0 else None,)

    def torch_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """torch's fused SGD, with the first step decided on device; it takes ``found_inf`` (and
        ``grad_scale``) itself: SGD's single torch form, on every device.

        The momentum buffers start at zero, so ``momentum * 0 + (1 - dampening) * d_p`` is
        torch's first-step ``buf = d_p`` whenever ``dampening == 0``; with dampening they are
        set to the first grad on device first, where the step counter is zero.
        """
        params, grads, buffers, steps = tensor_lists
        o = read_options(SgdOptions, group)
        if buffers and o.dampening != 0:
            unscaled = grads if grad_scale is None else list(torch._foreach_div(grads, grad_scale))
            _start_buffers_(params, unscaled, buffers, steps, o)
        torch._fused_sgd_(
            params, grads, buffers, **vars(o), is_first_step=False,
            grad_scale=grad_scale, found_inf=found_inf,
        )
        advance_steps_(steps, found_inf)

    def torch_form_(self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]]) -> None:
        """torch's fused SGD in place and taken, over counters that already count this step
        (the first step is the one they count as 1): the float32 update of a batch of decoded
        8-bit states (Note [low-bit batches]); the float32 states take :meth:`torch_update`."""
        params, grads, buffers, steps = tensor_lists
        o = read_options(SgdOptions, group)
        if buffers and o.dampening != 0:
            _start_buffers_(params, grads, buffers, [step - 1 for step in steps], o)
        torch._fused_sgd_(params, grads, buffers, **vars(o), is_first_step=False)

    def torch_optim_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        """:func:`torch.optim.sgd.sgd`, called as ``torch.optim.SGD.step`` calls it.

        torch creates a momentum buffer on a param's first step (``buf = d_p``), and ours exist
        from the start, zero until then: without dampening, ``momentum * 0 + d_p`` is that
        buffer exactly, and a buffer loaded with a step count of 0 is read as torch.optim reads a
        loaded one (as the kernel and :meth:`torch_update` read it). With dampening, torch's
        fused implementation, which skips on device, gets the buffers started on device as
        :meth:`torch_update` starts them; the others get ``None`` for a buffer whose first step
        this is (counters on the CPU: no sync), as does a differentiable step (torch starts the
        buffer detached from the graph), and the buffer they create is copied into ours.
        Ours stay dense for a sparse grad (torch's would be sparse; the values are the same), so
        a Nesterov step, which adds the buffer to the grad, is given the grad dense: torch cannot
        add a dense tensor to a sparse one.
        """
        params, grads, buffers, steps = tensor_lists
        first = [False] * len(buffers)
        if buffers and group["fused"]:
            if group["dampening"] != 0:
                _start_buffers_(params, grads, buffers, steps, read_options(SgdOptions, group))
        elif buffers and (group["dampening"] != 0 or group["differentiable"]):
            first = [step.item() == 0 for step in steps]
        if buffers and group["nesterov"]:
            grads = [grad.to_dense() if grad.is_sparse else grad for grad in grads]
        momentum_buffers: list[Tensor | None] = [
            None if is_first else buffer for buffer, is_first in zip(buffers, first)
        ]
        torch_sgd(
            params, grads, momentum_buffers, has_sparse_grad=any(g.is_sparse for g in grads),
            foreach=group["foreach"], fused=group["fused"], found_inf=found_inf,
            weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
        )
        for buffer, created, is_first in zip(buffers, momentum_buffers, first):
            if is_first:  # ours stays dense where torch's starts as a sparse grad's clone
                created = cast(Tensor, created)  # the implementation created it
                buffer.copy_(created.to_dense() if created.is_sparse else created)
        advance_steps_(steps, found_inf)


def _start_buffers_(
    params: list[Tensor],
    grads: list[Tensor],
    buffers: list[Tensor],
    steps: list[Tensor],
    o: SgdOptions,
) -> None:
    """Presets, on device, the momentum buffer of each param whose first step this is, so that
    ``momentum * buf + (1 - dampening) * d_p`` is torch's first-step ``buf = d_p`` (a skipped
    step must not count as the first one)."""
    for buf, param, grad, step in zip(buffers, params, grads, steps):
        d_p = grad.neg() if o.maximize else grad
        if o.weight_decay != 0:
            d_p = d_p.add(param, alpha=o.weight_decay)
        buf.copy_(torch.where(step == 0, d_p * (o.dampening / o.momentum), buf))


OptimizerSpec(
    cls=SGD,
    summary="a drop-in for torch.optim.SGD (momentum, dampening, Nesterov); 8-bit states",
    reference=torch.optim.SGD,
    configs=(
        Config(
            "momentum-nesterov-wd",
            dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
        ),
        Config("plain", dict(lr=0.05)),
        Config("momentum-wd", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
        Config(
            "dampening-maximize",
            dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, maximize=True),
        ),
    ),
    refusals=(
        ErrorInput(
            "nesterov without momentum", dict(lr=0.1, nesterov=True), ValueError, "Nesterov"
        ),
        ErrorInput(
            "nesterov with dampening",
            dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            "Nesterov",
        ),
    ),
)
