"""The split form of the step: :func:`unscale`, its first half (every grad unscaled in place and
checked, the decision committed at once), and :func:`validate_pending`, the request of
``step_after_unscale()``, its second half, which :func:`~scaledoptim.protocol.steps.run` takes.
Both read and keep the pending step of Note [atomic step] in ``steps.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..torch_ops import UnscaledBefore, unscale_in_place_
from .scaling import adopt_scale
from .steps import (
    check_closure_free,
    check_fp16_unscale,
    decide,
    left_pending,
    record_report,
    retried,
)
from .values import GradPass, Request, StepPlan

__all__ = ["unscale", "validate_pending"]


def unscale(optimizer: Any, request: Request, plan: StepPlan) -> GradPass:
    """The split form's first half: every grad unscaled in place and checked, the decision
    committed at once: the scale moves and the pass is pending for the step that consumes it;
    or, for a GradScaler (``request.moves_scale`` false), the optimizer takes its scale and the
    scaler keeps ``found_inf``. Scaled fp16 grads are refused first."""
    state = optimizer._scaledoptim_scaling
    scaled_by = request.scaled_by
    if scaled_by is not None:
        method = "unscale()" if request.moves_scale else "GradScaler.unscale_()"
        check_fp16_unscale(optimizer, plan, method)
    found_inf = torch.zeros((), dtype=torch.float32, device=state.loss_scale.scale.device)
    request = retried(state, request)
    unscaled = UnscaledBefore(request.unscaled) if request.unscaled else []
    if scaled_by is not None:
        try:  # See Note [atomic step]: a failure part way is retried by the next unscale
            inv_scale = scaled_by.double().reciprocal().float()
            unscale_in_place_(plan.grads, found_inf, inv_scale, unscaled)
        except BaseException:
            if request.moves_scale:
                state.pending = left_pending(plan, request, None, None, unscaled)
            raise
    grad_pass = GradPass(found_inf, skip=scaled_by is not None)
    try:
        grad_pass = decide(plan, state, request, grad_pass, id(optimizer))
    except BaseException:
        if request.moves_scale:
            state.pending = grad_pass  # the grads are unscaled: a second unscale is refused
        raise
    if request.adopt is not None:
        adopt_scale(optimizer, *request.adopt)
    if not request.moves_scale:
        return grad_pass
    if grad_pass.scale_update is not None:
        grad_pass.scale_update.apply()
    if grad_pass.report:
        record_report(state.loss_scale, id(optimizer), found_inf)
    state.pending = dataclasses.replace(grad_pass, scale_update=None, report=False)
    return grad_pass


def validate_pending(optimizer: Any) -> Request:
    """``step_after_unscale()``'s request: the pending step. It is planned again, not with
    ``unscale()``'s plan: code between the two calls may have changed anything a plan rests on
    (a fused step's kept plan is re-verified, with the grads unmoved: Note [step cache])."""
    pending = optimizer._scaling().pending
    if pending is None:
        raise RuntimeError(
            "step_after_unscale() needs the grads unscaled first: call "
            "opt.unscale(grads_scaled_by=S) after backward, or use opt.unscale_and_step()."
        )
    check_closure_free(optimizer, "step_after_unscale")
    return Request(pending=pending)
