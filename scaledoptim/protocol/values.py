"""The values the step's stages pass each other (``steps.py``): the request, validated; the pass
over the grads; and what a plan must answer."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from torch import Tensor

from ..scale import LossScale, ScaleUpdate

__all__ = ["PLAIN", "UNCHECKED", "GradPass", "Request", "StepPlan"]


@dataclasses.dataclass(frozen=True)
class GradPass:
    """One pass over a step's grads: made by the check, completed by the decision, read by the
    update and the commit.

    Attributes:
        found_inf: 0-dim float32, 1.0 when a grad, as the update will read it, is inf/nan;
            ``None`` when there was nothing to check (grads not scaled, a plain ``step()``).
        skip: whether the update skips on ``found_inf`` (``False``: the grads are not scaled).
        inv_scale: what the update still multiplies the grads the check left scaled by (the
            clip factor included once decided); ``None``: nothing is left scaled.
        grads: per part of the plan, the grads as the check left them and whether they are
            still scaled (``inv_scale`` applies); ``None``: the plan's grads, unscaled in place.
        sum_of_squares: of the unscaled grads, added up by the check when the step clips.
        norm: the total 2-norm before clipping (``grad_norm``), once decided.
        scale_update: the scale's next value, decided and not applied yet.
        report: the report to the scale (its round, its handle) is still to be recorded.
        partial: the plan whose update ran in part before a failure: the pending step runs the
            rest of it (Note [atomic step] in steps.py).
        retry: the request of a step whose check failed after it had unscaled grads in place:
            the pending step runs it again (Note [atomic step]).
    """

    found_inf: Tensor | None
    skip: bool = True
    inv_scale: Tensor | None = None
    grads: tuple[tuple[list[list[Tensor]], bool], ...] | None = None
    sum_of_squares: Tensor | None = None
    norm: Tensor | None = None
    scale_update: ScaleUpdate | None = None
    report: bool = False
    partial: StepPlan | None = None
    retry: Request | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """What a step must do besides the update, validated (see the ``validate_*`` functions).

    Attributes:
        scaled_by: the scale the grads are scaled by, a 0-dim float32 tensor on their device;
            ``None``: they are not scaled (nothing is skipped).
        pending: a pass checked and decided already (after ``unscale()``, or kept by a step that
            failed: Note [atomic step]); the step only updates and commits it.
        found_inf: a flag the check adds to (torch.amp.GradScaler's).
        moves_scale: the optimizer's own scale moves (``False``: a GradScaler moves it).
        adopt: a scaledoptim.GradScaler's scale the optimizer takes as its own at commit.
        max_grad_norm: clip the global norm of the unscaled grads to it; ``None``: no clip.
        sums_over_group: the clip's sums of squares are added over ``process_group``.
        unscaled: what a check of this request that failed had unscaled in place (lists of the
            tensors each of torch's unscales wrote): the check checks them, not unscales them
            again (Note [atomic step] in steps.py).
    """

    scaled_by: Tensor | None = None
    pending: GradPass | None = None
    found_inf: Tensor | None = None
    moves_scale: bool = True
    adopt: tuple[LossScale, str] | None = None
    max_grad_norm: float | None = None
    sums_over_group: bool = False
    unscaled: tuple[list[Tensor], ...] = ()


class StepPlan(Protocol):
    """A step validated by ``optimizer._plan_step()``, ready to run: ``params`` have a grad,
    ``grads`` are theirs (dense or strided, floating, on the scale's device, shaped like their
    param). The fused plan is ``fused/plan.py``'s, any other optimizer's ``plans.py``'s."""

    params: list[Tensor]
    grads: list[Tensor]

    def check(
        self,
        found_inf: Tensor,
        inv_scale: Tensor | None,
        checked: frozenset[int],
        norm_sq: Tensor | None,
        unscaled: list[list[Tensor]],
    ) -> tuple[tuple[list[list[Tensor]], bool], ...]:
        """Checks the grads (times ``inv_scale``) into ``found_inf``, unscaling them in place or
        leaving that to the update, and adds the squares of the unscaled grads to ``norm_sq``
        (of every grad: then ``checked``, the ids of grads checked during backward, is
        ignored). What it unscales in place is added to ``unscaled`` as it goes; what is in it
        already (a failed check's) is checked only. Returns :attr:`GradPass.grads`."""

    def clip(self, grad_pass: GradPass, coef: Tensor) -> GradPass:
        """``grad_pass`` with its grads times ``coef``: folded into its ``inv_scale``, or
        multiplied into grads unscaled in place."""

    def update(self, grad_pass: GradPass) -> Any:
        """Runs the optimizer's math on ``grad_pass`` (skipped where it says); returns what the
        optimizer's step returned. A failure leaves the counters of what did not run unmoved."""

    def commit(self, grad_pass: GradPass) -> None:
        """Installs new state, advances what the update left to the end of the step and applies
        ``grad_pass.scale_update``."""

    def settle(self, grad_pass: GradPass) -> GradPass | None:
        """After a failure past the check: ``None`` when no grad the user holds was written,
        else the pass to keep pending: the rest of this plan's update (``partial``) when it ran
        in part, else the user's grads made what :func:`unscale` leaves (Note [atomic
        step])."""


#: The request of a plain ``step()`` that owes the protocol nothing, and its pass.
PLAIN = Request()
UNCHECKED = GradPass(None, skip=False)
