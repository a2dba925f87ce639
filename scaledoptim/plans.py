"""The plans of the step sequence: everything validated, ready to commit (see optimizer.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from .backends import unscale_in_place_

if TYPE_CHECKING:
    from .optimizer import Optimizer
    from .scaling import ScaleUpdate

__all__ = ["GenericStepPlan", "StepPlan", "UnscalePlan"]


@dataclasses.dataclass
class UnscalePlan:
    """A validated unscale: the scale (``None``: grads not scaled), its reciprocal and a fresh
    ``found_inf``."""

    scale: torch.Tensor | None
    inv_scale: torch.Tensor | None
    found_inf: torch.Tensor
    # ids of grads already folded into found_inf during backward (Note [overlapped overflow check])
    checked: frozenset[int] = frozenset()


class StepPlan(Protocol):
    """A validated step, ready to commit: only device errors can interrupt it now.

    ``params`` are the params that have a grad, ``grads`` their ``.grad``s (validated: dense or
    strided, floating, on the loss scale's device, shaped like their param).
    ``applies_scale_update``: the step's epilogue moves the loss scale, so the protocol hands it
    the :class:`~scaledoptim.scaling.ScaleUpdate` instead of applying it before the step.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    applies_scale_update: bool

    def unscale_grads_(
        self,
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        checked: frozenset[int] = frozenset(),
    ) -> torch.Tensor | None:
        """Checks (and unscales, or leaves to the update) the grads; returns the ``inv_scale``
        the update must still apply, or ``None`` when the grads were unscaled in place."""

    def step(
        self,
        found_inf: torch.Tensor | None,
        inv_scale: torch.Tensor | None,
        scale_update: ScaleUpdate | None = None,
    ) -> None:
        """Runs ``optimizer.step()``, skipped where ``found_inf`` is set."""


class GenericStepPlan:
    """The step of an optimizer we cannot see into: ``self.step()`` as it is."""

    applies_scale_update = False

    def __init__(self, optimizer: Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params
        self.grads = [p.grad for p in params]

    def unscale_grads_(
        self,
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        checked: frozenset[int] = frozenset(),
    ) -> None:
        unscale_in_place_(self.grads, found_inf, inv_scale)

    def step(
        self,
        found_inf: torch.Tensor | None,
        inv_scale: torch.Tensor | None,
        scale_update: ScaleUpdate | None = None,
    ) -> None:
        opt = self.optimizer
        if found_inf is None:
            opt.step()
        elif getattr(opt, "_step_supports_amp_scaling", False):
            opt.grad_scale, opt.found_inf = None, found_inf
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif found_inf.item() == 0.0:  # the documented host read of a generic step
            opt.step()
