"""SGD: hyper-parameters, state and the call into the fused update."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from ._fused import FusedOptimizer, check_hyperparameter, reject_differentiable

__all__ = ["SGD"]


class SGD(FusedOptimizer):
    r"""SGD (momentum, dampening, Nesterov) with the loss-scaling protocol, a drop-in for
    :class:`torch.optim.SGD`.

    Same signature, same math, same state name (``momentum_buffer``), plus a ``step`` counter of
    taken steps kept on device, so that a skipped first step does not count as the step that
    initialises the momentum buffer. ``foreach`` and ``fused`` are accepted for compatibility.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: weight decay (L2 penalty).
        nesterov: enables Nesterov momentum.
        maximize: maximize the objective instead of minimizing.
    """

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
    ) -> None:
        check_hyperparameter("learning rate", lr)
        check_hyperparameter("momentum value", momentum)
        check_hyperparameter("weight_decay value", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        reject_differentiable(differentiable)
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if group["momentum"] != 0:
            state["momentum_buffer"] = self._zeros_like_state(param)

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        backend: ModuleType,
        scaling: dict[str, torch.Tensor | None],
    ) -> None:
        momentum = group["momentum"]
        backend.sgd_(
            params, grads,
            [s["momentum_buffer"] for s in states] if momentum != 0 else [],
            [s["step"] for s in states],
            lr=group["lr"], momentum=momentum, dampening=group["dampening"],
            nesterov=group["nesterov"], weight_decay=group["weight_decay"],
            maximize=group["maximize"], **scaling,
        )  # fmt: skip
