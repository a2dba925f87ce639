"""The plans of the step sequence: everything validated, ready to commit (see optimizer.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ..scale import LossScale, ScaleUpdate
from ..torch_ops import unscale_in_place_
from .clipping import clip_in_place_, sum_of_squares

__all__ = [
    "GenericStepPlan",
    "PendingStep",
    "StepOutcome",
    "StepPlan",
    "StepRequest",
    "UnscalePlan",
    "native_amp_scaling",
]


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """What a ``step()`` owes the protocol besides the update (Note [step requests] in
    optimizer.py).

    Attributes:
        unscale: check the grads first, unscaling them by ``scaled_by`` (``None``: they are not
            scaled; nothing is checked or skipped).
        scaled_by: the scale the grads were scaled by.
        found_inf: skip where it is set; given when the grads were checked already (after
            :meth:`Optimizer.unscale`), or the flag a check adds to.
        moves_scale: the unscale reports to the optimizer's own scale, which moves (its own
            protocol); ``False`` when a GradScaler owns the scale and moves it in ``update()``.
        adopt: a GradScaler's scale for the optimizer to take as its own, once every check
            passed.
        max_grad_norm: clip the global norm of the unscaled grads to it (Note [clipping in the
            step] in clipping.py); ``None``: no clipping. Only with ``unscale``.

    The step answers with a :class:`StepOutcome`.
    """

    unscale: bool
    scaled_by: torch.Tensor | float | None = None
    found_inf: torch.Tensor | None = None
    moves_scale: bool = True
    adopt: tuple[LossScale, str] | None = None
    max_grad_norm: float | None = None


class StepOutcome(NamedTuple):
    """What a step that carried out a :class:`StepRequest` used.

    Attributes:
        found_inf: the ``found_inf`` the update skipped on.
        scale: the recommended scale (the optimizer's own protocol only, else ``None``).
    """

    found_inf: torch.Tensor
    scale: torch.Tensor | None


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
        norm_sq: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Checks (and unscales, or leaves to the update) the grads; returns the ``inv_scale``
        the update must still apply, or ``None`` when the grads were unscaled in place.
        ``norm_sq``: a 0-dim float32 tensor to add the sum of squares of the unscaled grads to
        (Note [clipping in the step] in clipping.py); ``checked`` is then ignored."""

    def clip_grads_(self, coef: torch.Tensor) -> None:
        """Makes the update read the unscaled grads times ``coef`` (after
        :meth:`unscale_grads_`): folded into the ``inv_scale`` the update applies, or
        multiplied into grads unscaled in place."""

    def commit(self, pending: PendingStep) -> Any:
        """Runs the update, skipped where ``pending.found_inf`` is set; returns what the
        optimizer's step returned (``None`` for a step skipped on the host)."""


class GenericStepPlan:
    """The step of an optimizer we cannot see into: its ``step()`` as it is.

    Args:
        optimizer: the optimizer.
        params: its params that have a grad.
        run: what runs the update; ``None``: ``optimizer.step()``, as hooks, schedulers and the
            profiler see a step (the protocol commits with its guard open: Note [step requests]
            in optimizer.py). The guard passes the step function it wraps, when a plain
            ``step()`` call is already under way.
    """

    applies_scale_update = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        run: Callable[[], Any] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.grads = [p.grad for p in params if p.grad is not None]  # every one has a grad
        self.run = run

    def unscale_grads_(
        self,
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        checked: frozenset[int] = frozenset(),
        norm_sq: torch.Tensor | None = None,
    ) -> None:
        unscale_in_place_(self.grads, found_inf, inv_scale)
        if norm_sq is not None and self.grads:
            norm_sq.add_(sum_of_squares(self.grads))

    def clip_grads_(self, coef: torch.Tensor) -> None:
        if self.grads:
            clip_in_place_(self.grads, coef)

    def commit(self, pending: PendingStep) -> Any:
        opt, found_inf = self.optimizer, pending.found_inf
        if found_inf is None:
            return self._run()
        if native_amp_scaling(opt):
            opt.grad_scale, opt.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                return self._run()
            finally:
                del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]
        if found_inf.item() == 0.0:  # the documented host read of a generic step
            return self._run()
        return None

    def _run(self) -> Any:
        # The protocol commits with its guard open (Optimizer._execute), so opt.step() is let
        # through as it is.
        return self.run() if self.run is not None else self.optimizer.step()


def native_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s own ``step()`` implements torch's on-device ``found_inf`` /
    ``grad_scale`` protocol (torch's fused optimizers set ``_step_supports_amp_scaling`` on the
    instance). Read from the instance: scaledoptim's class-level answer is for
    ``torch.amp.GradScaler`` (see ``Optimizer._step_supports_amp_scaling``)."""
    return bool(vars(optimizer).get("_step_supports_amp_scaling", False))
