"""Adam and AdamW: hyper-parameters, state, and the update as kernel arguments and torch ops."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..backends.torch_native import advance_steps_
from ..kernels.adam import ADAM, AdamArgs, adam_args
from ..validation import hyperparameter
from .fused import FusedOptimizer, check_hyperparameter

__all__ = ["Adam", "AdamW"]


class Adam(FusedOptimizer):
    r"""Adam with the loss-scaling protocol, a drop-in for :class:`torch.optim.Adam`.

    Same signature, same math, same state names (``step``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``). Always fused: the whole update is one multi-tensor op that skips on
    ``found_inf`` on device. ``lr`` and ``betas`` may be one-element CPU tensors, read at each
    step (CUDA tensors are refused: reading them would sync). ``foreach``, ``fused`` and
    ``capturable`` are accepted for compatibility and do not change the path. State is fp32
    whatever the param dtype, and 16-bit params are updated in fp32 and rounded once.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        betas: coefficients for the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: weight decay coefficient (L2 penalty, or decoupled: see below).
        amsgrad: use the maximum of past squared-gradient averages.
        maximize: maximize the objective instead of minimizing.
        decoupled_weight_decay: apply weight decay as AdamW does.
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
    """

    kernel = ADAM
    _legacy_options: ClassVar[dict[str, Any]] = {
        "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
        "differentiable": False, "decoupled_weight_decay": False, "fused": None,
    }  # fmt: skip

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
        master_weights: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _check_options(self, options: dict[str, Any]) -> None:
        check_hyperparameter("learning rate", hyperparameter("lr", options["lr"]))
        check_hyperparameter("epsilon value", options["eps"])
        betas = [hyperparameter(f"betas[{i}]", beta) for i, beta in enumerate(options["betas"])]
        check_hyperparameter("beta parameter at index 0", betas[0], high=1.0)
        check_hyperparameter("beta parameter at index 1", betas[1], high=1.0)
        check_hyperparameter("weight_decay value", options["weight_decay"])
        reject_differentiable(options["differentiable"])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq" if group["amsgrad"] else None)

    def _kernel_args(self, group: dict[str, Any], found_inf: int | None, inv_scale: int | None) -> AdamArgs:
        return adam_args(found_inf, inv_scale, **_adam_options(group))

    def _torch_update(
        self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]], found_inf: torch.Tensor | None
    ) -> None:
        *tensors, steps = tensor_lists
        advance_steps_(steps, found_inf)  # torch's fused Adam reads the advanced counter
        options = _adam_options(group)
        fused = torch._fused_adamw_ if options.pop("decoupled_weight_decay") else torch._fused_adam_
        fused(*tensors, steps, **options, found_inf=found_inf)


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
        master_weights: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
        )  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch.optim.AdamW: a checkpoint saved by Adam still steps as AdamW.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def _adam_options(group: dict[str, Any]) -> dict[str, Any]:
    beta1, beta2 = (hyperparameter("betas", beta) for beta in group["betas"])
    return dict(
        lr=hyperparameter("lr", group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
        weight_decay=group["weight_decay"], decoupled_weight_decay=group["decoupled_weight_decay"],
        amsgrad=group["amsgrad"], maximize=group["maximize"],
    )  # fmt: skip


def reject_differentiable(differentiable: bool) -> None:
    """fused updates are not differentiable: say what is."""
    if differentiable:
        raise ValueError(
            "differentiable=True is not supported by scaledoptim's fused optimizers; use the "
            "torch.optim class (scaledoptim.with_scaling(torch.optim.X) keeps the protocol)"
        )
