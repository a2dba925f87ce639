"""The plan of an optimizer the protocol cannot see into: its own ``step()`` as it is (the
``StepPlan`` of ``steps.py``; the fused optimizers plan in ``fused/plan.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..torch_ops import unscale_in_place_
from .clipping import clip_in_place_, sum_of_squares
from .validation import check_param_grads
from .values import GradPass

__all__ = ["GenericStepPlan", "check_param_groups", "native_amp_scaling"]

#: Options torch.optim's ``__setstate__`` (run by ``load_state_dict``) adds to the defaults of
#: every optimizer, but not to the groups of those that never had them (LBFGS, SparseAdam, Muon,
#: Adafactor): their groups may lack them.
_DEFAULTS_ONLY = frozenset({"differentiable"})


class GenericStepPlan:
    """The step of an optimizer we cannot see into: every grad unscaled in place by the check,
    then its ``step()``, skipped after a host read of ``found_inf`` unless it takes torch's own
    on-device ``found_inf`` (``native_amp_scaling``).

    Args:
        optimizer: the optimizer, its param groups validated (:func:`check_param_groups`).
        run: what runs the update; ``None``: ``optimizer.step()``, as hooks, schedulers and the
            profiler see a step (the protocol lets it through its guard: Note [step requests]
            in guard.py). The guard passes the step function it wraps, when a plain
            ``step()`` call is already under way.
    """

    def __init__(self, optimizer: Any, run: Callable[[], Any] | None) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        check_param_grads(self.params, optimizer._scaledoptim_scaling.loss_scale.device)
        self.grads: list[Tensor] = [p.grad for p in self.params]
        self.run = run

    def check(
        self,
        found_inf: Tensor,
        inv_scale: Tensor | None,
        checked: frozenset[int],
        norm_sq: Tensor | None,
        unscaled: list[list[Tensor]],
    ) -> tuple[tuple[list[list[Tensor]], bool], ...]:
        if inv_scale is not None:
            unscale_in_place_(self.grads, found_inf, inv_scale, unscaled)
        if norm_sq is not None and self.grads:
            norm_sq.add_(sum_of_squares(self.grads))
        return (([self.grads], False),)

    def clip(self, grad_pass: GradPass, coef: Tensor) -> GradPass:
        if self.grads:
            clip_in_place_(self.grads, coef)
        return grad_pass

    def update(self, grad_pass: GradPass) -> Any:
        opt, found_inf = self.optimizer, grad_pass.found_inf if grad_pass.skip else None
        if found_inf is None:
            return self._run()
        if native_amp_scaling(opt):
            opt.grad_scale, opt.found_inf = None, found_inf
            try:
                return self._run()
            finally:
                del opt.grad_scale, opt.found_inf
        if found_inf.item() == 0.0:  # the documented host read of a generic step
            return self._run()
        return None

    def commit(self, grad_pass: GradPass) -> None:
        if grad_pass.scale_update is not None:
            grad_pass.scale_update.apply()

    def settle(self, grad_pass: GradPass) -> GradPass | None:
        # The check unscaled (and the decision clipped) the user's grads in place.
        written = grad_pass.grads is not None and bool(self.grads)
        return dataclasses.replace(grad_pass, grads=None) if written else None

    def _run(self) -> Any:
        return self.run() if self.run is not None else self.optimizer.step()


def check_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """Rejects a param group that lost an option its optimizer's defaults have (torch would
    raise a bare ``KeyError`` mid-step)."""
    for index, group in enumerate(optimizer.param_groups):
        if optimizer.defaults.keys() <= group.keys():
            continue
        missing = sorted(optimizer.defaults.keys() - group.keys() - _DEFAULTS_ONLY)
        if missing:
            raise ValueError(
                f"param_groups[{index}] has no {missing}: every param group must hold all of "
                f"{type(optimizer).__name__}'s options. Add groups with opt.add_param_group(...) "
                "(it fills in the defaults), or restore the key, e.g. "
                f"opt.param_groups[{index}][{missing[0]!r}] = opt.defaults[{missing[0]!r}]"
            )


def native_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s own ``step()`` implements torch's on-device ``found_inf`` /
    ``grad_scale`` protocol (torch's fused optimizers set ``_step_supports_amp_scaling`` on the
    instance). Read from the instance: scaledoptim's class-level answer is for
    ``torch.amp.GradScaler`` (Note [torch GradScaler] in guard.py)."""
    return bool(vars(optimizer).get("_step_supports_amp_scaling", False))
