"""Lion: hyper-parameters, state, and the update as kernel arguments and torch ops."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..backends.torch_native import advance_steps_, copy_unless_skipped_
from ..kernels.lion import LION, LionArgs, lion_args
from .fused import FusedOptimizer, check_hyperparameter

__all__ = ["Lion"]


class Lion(FusedOptimizer):
    r"""Lion (Chen et al., 2023) with the loss-scaling protocol, fused and sync-free.

    Each step: ``c = beta1 * m + (1 - beta1) * g``;
    ``p = p * (1 - lr * weight_decay) - lr * sign(c)`` (``sign(0) = 0``);
    ``m = beta2 * m + (1 - beta2) * g``. State: ``exp_avg`` (fp32 whatever the param dtype) and ``step``.

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

    Example::

        >>> opt = scaledoptim.Lion(model.parameters(), lr=1e-4, weight_decay=1.0)
        >>> _, found_inf, S = opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    """

    kernel = LION

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
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _check_options(self, options: dict[str, Any]) -> None:
        check_hyperparameter("learning rate", options["lr"])
        check_hyperparameter("beta parameter at index 0", options["betas"][0], high=1.0)
        check_hyperparameter("beta parameter at index 1", options["betas"][1], high=1.0)
        check_hyperparameter("weight_decay value", options["weight_decay"])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("exp_avg",)

    def _kernel_args(
        self, group: dict[str, Any], found_inf: int | None, inv_scale: int | None
    ) -> LionArgs:
        return lion_args(found_inf, inv_scale, **_lion_options(group))

    def _torch_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        params, grads, exp_avgs, steps = tensor_lists
        o = _lion_options(group)
        if o["maximize"]:
            grads = torch._foreach_neg(grads)
        c = torch._foreach_mul(exp_avgs, o["beta1"])
        torch._foreach_add_(c, torch._foreach_mul(grads, 1 - o["beta1"]))
        new_params = torch._foreach_mul(params, 1 - o["lr"] * o["weight_decay"])
        torch._foreach_sub_(new_params, torch._foreach_mul(torch._foreach_sign(c), o["lr"]))
        new_exp_avgs = torch._foreach_mul(exp_avgs, o["beta2"])
        torch._foreach_add_(new_exp_avgs, torch._foreach_mul(grads, 1 - o["beta2"]))
        copy_unless_skipped_(params, new_params, found_inf)
        copy_unless_skipped_(exp_avgs, new_exp_avgs, found_inf)
        advance_steps_(steps, found_inf)


def _lion_options(group: dict[str, Any]) -> dict[str, Any]:
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                maximize=group["maximize"])  # fmt: skip
