"""Adagrad: hyper-parameters, state, and the update as kernel arguments and torch ops."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..backends.torch_native import advance_steps_
from ..kernels.adagrad import ADAGRAD, AdagradArgs, adagrad_args
from .adam import reject_differentiable
from .fused import FusedOptimizer, check_hyperparameter
from .state import state_dtype

__all__ = ["Adagrad"]


class Adagrad(FusedOptimizer):
    r"""Adagrad with the loss-scaling protocol, a drop-in for :class:`torch.optim.Adagrad`.

    Same signature, same math, same state names (``sum``, ``step``), created when a param
    joins the optimizer as torch does (``sum`` filled with ``initial_accumulator_value``).
    Fused and sync-free; ``foreach`` and ``fused`` are accepted for compatibility. State is fp32
    whatever the param dtype.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        lr_decay: learning rate decay: step ``t`` uses ``lr / (1 + (t - 1) * lr_decay)``.
        weight_decay: weight decay (L2 penalty).
        initial_accumulator_value: initial value of the sum of squared gradients.
        eps: term added to the denominator for numerical stability.
        maximize: maximize the objective instead of minimizing.
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
    """

    kernel = ADAGRAD

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
            maximize=maximize, differentiable=differentiable, fused=fused,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
        )  # fmt: skip
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.add_param_group`, creating the group's state as
        torch.optim.Adagrad does in its constructor."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for param in group["params"]:
            if param not in self.state or not self.state[param]:
                self.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32, device=param.device),
                    "sum": torch.full_like(param, group["initial_accumulator_value"], dtype=state_dtype(param),
                                           memory_format=torch.preserve_format),
                }  # fmt: skip

    def _check_options(self, options: dict[str, Any]) -> None:
        check_hyperparameter("learning rate", options["lr"])
        check_hyperparameter("lr_decay value", options["lr_decay"])
        check_hyperparameter("weight_decay value", options["weight_decay"])
        check_hyperparameter(
            "initial_accumulator_value value", options["initial_accumulator_value"]
        )
        check_hyperparameter("epsilon value", options["eps"])
        reject_differentiable(options["differentiable"])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("sum",)

    def _kernel_args(
        self, group: dict[str, Any], found_inf: int | None, inv_scale: int | None
    ) -> AdagradArgs:
        return adagrad_args(found_inf, inv_scale, **_adagrad_options(group))

    def _torch_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        """torch's fused Adagrad (checked against torch.optim.Adagrad's single-tensor math on
        CPU, skips included), which reads the advanced counter."""
        params, grads, sums, steps = tensor_lists
        advance_steps_(steps, found_inf)
        torch._fused_adagrad_(
            params, grads, sums, steps, **_adagrad_options(group), found_inf=found_inf
        )


def _adagrad_options(group: dict[str, Any]) -> dict[str, Any]:
    return dict(lr=group["lr"], lr_decay=group["lr_decay"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"])  # fmt: skip
