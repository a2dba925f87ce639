"""SGD: hyper-parameters, state, and the update as kernel arguments and torch ops."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..backends.torch_native import advance_steps_
from ..kernels.sgd import SGD as SGD_KERNEL
from ..kernels.sgd import SgdArgs, sgd_args
from ..validation import hyperparameter
from .adam import reject_differentiable
from .fused import FusedOptimizer, check_hyperparameter

__all__ = ["SGD"]


class SGD(FusedOptimizer):
    r"""SGD (momentum, dampening, Nesterov) with the loss-scaling protocol, a drop-in for
    :class:`torch.optim.SGD`.

    Same signature, same math, same state name (``momentum_buffer``), plus a ``step`` counter of
    taken steps kept on device, so that a skipped first step does not count as the step that
    initialises the momentum buffer. ``lr`` may be a one-element CPU tensor, read at each step.
    ``foreach`` and ``fused`` are accepted for compatibility.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: weight decay (L2 penalty).
        nesterov: enables Nesterov momentum.
        maximize: maximize the objective instead of minimizing.
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
    """

    kernel = SGD_KERNEL
    _legacy_options: ClassVar[dict[str, Any]] = {
        "nesterov": False, "maximize": False, "foreach": None, "differentiable": False, "fused": False,
    }  # fmt: skip

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _check_options(self, options: dict[str, Any]) -> None:
        check_hyperparameter("learning rate", hyperparameter("lr", options["lr"]))
        check_hyperparameter("momentum value", options["momentum"])
        check_hyperparameter("weight_decay value", options["weight_decay"])
        if options["nesterov"] and (options["momentum"] <= 0 or options["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        reject_differentiable(options["differentiable"])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("momentum_buffer" if group["momentum"] != 0 else None,)

    def _kernel_args(self, group: dict[str, Any], found_inf: int | None, inv_scale: int | None) -> SgdArgs:
        return sgd_args(found_inf, inv_scale, **_sgd_options(group))

    def _torch_update(
        self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]], found_inf: torch.Tensor | None
    ) -> None:
        """torch's fused SGD, with the first step decided on device.

        The momentum buffers start at zero, so ``momentum * 0 + (1 - dampening) * d_p`` is
        torch's first-step ``buf = d_p`` whenever ``dampening == 0``. With dampening, the buffer
        of a param whose first step is still to be taken is pre-set on device so the same
        formula yields ``d_p``: a skipped step must not count as the first one.
        """
        params, grads, buffers, steps = tensor_lists
        options = _sgd_options(group)
        momentum, dampening = options["momentum"], options["dampening"]
        if buffers and dampening != 0:
            for buf, param, grad, step in zip(buffers, params, grads, steps):
                d_p = grad.neg() if options["maximize"] else grad
                if options["weight_decay"] != 0:
                    d_p = d_p.add(param, alpha=options["weight_decay"])
                buf.copy_(torch.where(step == 0, d_p * (dampening / momentum), buf))
        torch._fused_sgd_(
            params, grads, buffers, **options, is_first_step=False, found_inf=found_inf
        )
        advance_steps_(steps, found_inf)


def _sgd_options(group: dict[str, Any]) -> dict[str, Any]:
    return dict(
        lr=hyperparameter("lr", group["lr"]), momentum=group["momentum"], dampening=group["dampening"],
        nesterov=group["nesterov"], weight_decay=group["weight_decay"], maximize=group["maximize"],
    )  # fmt: skip
