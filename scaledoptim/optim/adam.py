"""Adam and AdamW: hyper-parameters, state and the call into the fused update."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from ._fused import FusedOptimizer, check_hyperparameter, reject_differentiable

__all__ = ["Adam", "AdamW"]


class Adam(FusedOptimizer):
    r"""Adam with the loss-scaling protocol, a drop-in for :class:`torch.optim.Adam`.

    Same signature, same math, same state names (``step``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``). Always fused: the whole update is one multi-tensor op that skips on
    ``found_inf`` on device. ``foreach``, ``fused`` and ``capturable`` are accepted for
    compatibility and do not change the path. State is fp32 whatever the param dtype, and 16-bit
    params are updated in fp32 and rounded once.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        betas: coefficients for the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: weight decay coefficient (L2 penalty, or decoupled: see below).
        amsgrad: use the maximum of past squared-gradient averages.
        maximize: maximize the objective instead of minimizing.
        decoupled_weight_decay: apply weight decay as AdamW does.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        check_hyperparameter("learning rate", lr)
        check_hyperparameter("epsilon value", eps)
        check_hyperparameter("beta parameter at index 0", betas[0], high=1.0)
        check_hyperparameter("beta parameter at index 1", betas[1], high=1.0)
        check_hyperparameter("weight_decay value", weight_decay)
        reject_differentiable(differentiable)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["exp_avg"] = self._zeros_like_state(param)
        state["exp_avg_sq"] = self._zeros_like_state(param)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._zeros_like_state(param)

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        backend: ModuleType,
        scaling: dict[str, torch.Tensor | None],
    ) -> None:
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        backend.adam_(
            params, grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            [s["step"] for s in states],
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=amsgrad, maximize=group["maximize"], **scaling,
        )  # fmt: skip


class AdamW(Adam):
    r"""AdamW with the loss-scaling protocol, a drop-in for :class:`torch.optim.AdamW`.

    :class:`Adam` with decoupled weight decay (``param *= 1 - lr * weight_decay``) and
    ``weight_decay=1e-2`` by default. See :class:`Adam` for the arguments.

    Example::

        >>> opt = scaledoptim.AdamW(model.parameters(), lr=1e-3)
        >>> S = opt.scale
        >>> scaledoptim.scale_outputs(loss_fn(model(x), y), S).backward()
        >>> _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
        )  # fmt: skip
