"""The plans of the step sequence: everything validated, ready to commit (see optimizer.py)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from ..scale import ScaleUpdate
from ..torch_ops import unscale_in_place_

__all__ = ["GenericStepPlan", "PendingStep", "StepPlan", "UnscalePlan"]


@dataclasses.dataclass
class UnscalePlan:
    """A validated unscale: the scale (``None``: grads not scaled), its reciprocal and a fresh
    ``found_inf``."""

    scale: torch.Tensor | None
    inv_scale: torch.Tensor | None
    found_inf: torch.Tensor
    # ids of grads already folded into found_inf during backward (Note [overlapped overflow check])
    checked: frozenset[int] = frozenset()


@dataclasses.dataclass
class PendingStep:
    """What a planned step needs when ``optimizer.step()`` commits it.

    Attributes:
        found_inf: skip the update where it is non-zero (``None``: always step).
        inv_scale: the reciprocal scale the update must still apply to the grads (``None``:
            they are unscaled, or were never scaled).
        scale_update: the scale's move, for a step whose epilogue applies it.
    """

    found_inf: torch.Tensor | None
    inv_scale: torch.Tensor | None = None
    scale_update: ScaleUpdate | None = None


class StepPlan(Protocol):
    """A validated step, ready to commit: only device errors can interrupt it now.

    ``params`` are the params that have a grad, ``grads`` their ``.grad``s (validated: dense or
    strided, floating, on the loss scale's device, shaped like their param).
    ``applies_scale_update``: the step's epilogue moves the loss scale, so the protocol hands it
    the :class:`~scaledoptim.scale.ScaleUpdate` instead of applying it before the step.
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

    def step(self, pending: PendingStep) -> None:
        """Runs ``optimizer.step()``, skipped where ``pending.found_inf`` is set."""


class GenericStepPlan:
    """The step of an optimizer we cannot see into: ``self.step()`` as it is."""

    applies_scale_update = False

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params
        self.grads = [p.grad for p in params if p.grad is not None]  # every one has a grad

    def unscale_grads_(
        self,
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        checked: frozenset[int] = frozenset(),
    ) -> None:
        unscale_in_place_(self.grads, found_inf, inv_scale)

    def step(self, pending: PendingStep) -> None:
        opt, found_inf = self.optimizer, pending.found_inf
        if found_inf is None:
            opt.step()
        elif getattr(opt, "_step_supports_amp_scaling", False):
            opt.grad_scale, opt.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]
        elif found_inf.item() == 0.0:  # the documented host read of a generic step
            opt.step()
