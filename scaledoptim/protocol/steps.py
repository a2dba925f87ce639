"""The step as one pipeline: every protocol step runs these stages, in this order.

::

    validate_request(...)              -> Request    every argument in the form the stages use
    plan(optimizer)                    -> StepPlan   params, grads, state and updates, validated
    check(plan, state, request)        -> GradPass   found_inf (+ the sum of squares to clip)
    decide(plan, state, request, pass) -> GradPass   found_inf agreed, the clip factor, the
                                                     scale's next value
    plan.update(pass)                                the optimizer's math
    commit(optimizer, plan, request, pass)           counters, scale, trackers, grad_norm

:func:`run` strings them together for ``unscale_and_step``, ``step_after_unscale``, a plain
``step()`` the protocol owes something (Note [step requests] in guard.py) and
:class:`scaledoptim.GradScaler`; the split form's first half, ``unscale()``, runs the check and
the decision and commits it at once (``split_form.py``); closure replay runs them for every
evaluation (``replay.py``).

Note [atomic step]
~~~~~~~~~~~~~~~~~~
Nothing observable is committed before the update has run: the recorded ``found_inf``, the scale
and its trackers, the step counters, ``grad_norm``, new optimizer state. Nothing is snapshotted:
where a failure wrote what the user holds, a pending step is kept (``zero_grad()`` drops it):

* nothing written (our kernels unscale in registers; a failure before torch's first in-place
  unscale, or in the first group's update where torch's fused ops unscale in their own read):
  nothing is kept, and the same call again takes exactly the step this one would have;
* the check failed after torch's in-place unscale wrote grads (a call per dtype): what each call
  wrote is recorded as it returns (a list append, no pass) and kept with the request
  (``GradPass.retry``). The next ``unscale_and_step()`` or ``unscale()`` (same scale, or refused;
  the latter's own failure is kept alike) or ``step_after_unscale()`` checks those grads as they
  are (``UnscaledBefore``: times one, the same ``found_inf``) and unscales the others;
* the update failed before any group's ran, the grads unscaled in place: the plan settles them
  as :meth:`~scaledoptim.Optimizer.unscale` leaves them (unscaled, clipped) and keeps the
  decided pass: ``step_after_unscale()`` takes exactly the step this call would have taken;
* the update failed after some groups' updates ran: the decided pass is kept with its plan
  (``GradPass.partial``), which counts them, the failing group's counters put back (the torch
  forms advance them with the math). ``step_after_unscale()`` rolls forward: the rest of that
  plan, then one commit: the clean step in total.

Not covered: a failure in the decision (the agreement over ``process_group``, the clip's and the
scale's ops) keeps a skip pending (a rank cannot know whether another overflowed); a failure
inside one group's update after it wrote part of its params or state (only a snapshot of the
group at every step, a pass, could undo it); ``zero_grad()`` after a partial update (the groups
that ran stay moved); a retry of a DTensor step that clips over a mesh (its sum of squares, taken
before the unscale, would read grads already unscaled), or on our kernels after a try on torch's
(``SCALEDOPTIM_KERNELS`` changed between); a step a GradScaler drives (``scaler.step(opt)`` does
not read a pending step). tests/protocol/test_atomic_step.py injects failures at the first and
second group's update and in the check (of both forms); the second case not covered is its
strict xfail.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import compile_boundary
from ..scale import LossScale, ScaleUpdate, agree_on_found_inf, as_scale_tensor, handle_state
from ..torch_ops import UnscaledBefore
from .clipping import norm_and_coefficient, sums_over_process_group, to_max_grad_norm
from .outputs import check_grads_scaled_by
from .plans import GenericStepPlan
from .scaling import adopt_scale
from .validation import check_no_fp16_grads
from .values import PLAIN, UNCHECKED, GradPass, Request, StepPlan

__all__ = [
    "check",
    "check_can_unscale",
    "check_closure_free",
    "check_fp16_unscale",
    "commit",
    "decide",
    "left_pending",
    "own_state",
    "plan",
    "planned_step",
    "record_report",
    "retried",
    "run",
    "run_step",
    "validate_request",
]


# ---------------------------------------------------------------------------------- validate
def validate_request(
    optimizer: Any,
    state: Any,
    scaled_by: Tensor | float | None,
    max_grad_norm: Any = None,
) -> Request:
    """The request of the optimizer's own protocol: the scale validated
    (:func:`validate_scale`), ``max_grad_norm`` a float or ``None`` (Note [clipping in the
    step] in clipping.py), whether the sums of squares are added over ``process_group``;
    refused before anything changes."""
    clip = None if max_grad_norm is None else to_max_grad_norm(max_grad_norm)
    sums = clip is not None and sums_over_process_group(
        [p for g in optimizer.param_groups for p in g["params"]],
        state.process_group,
        state.grads_across_ranks,
    )
    scale = validate_scale(state, id(optimizer), scaled_by)
    return Request(scale, max_grad_norm=clip, sums_over_group=sums)


def validate_scale(
    state: Any, reporter: int, scaled_by: Tensor | float | None
) -> Tensor | None:
    """``scaled_by`` as the scale tensor the stages use: ``opt.scale`` as it is (valid by
    construction), another value checked (a handle no longer in use, a bad value, the wrong
    scale for the backward that made the grads: Note [scale handles])."""
    loss_scale = state.loss_scale
    if scaled_by is None or scaled_by is loss_scale.scale:
        if scaled_by is not None and loss_scale.sharers > 1:
            loss_scale.check_can_report(reporter)
        return scaled_by
    handle = handle_state(scaled_by) if isinstance(scaled_by, Tensor) else None
    if handle is not None and handle["retired"] is not None:
        raise RuntimeError(f"grads_scaled_by is a scale no longer in use. {handle['retired']}")
    scale = as_scale_tensor(scaled_by, loss_scale.device)
    loss_scale.check_can_report(reporter)
    check_grads_scaled_by(scaled_by, loss_scale.scale, loss_scale.scaled_for(reporter))
    return scale


def own_state(optimizer: Any, method: str) -> Any:
    """The optimizer's state, refusing its own unscale methods when a GradScaler moves its scale
    (in ``update()``: they would move it too)."""
    state = optimizer._scaledoptim_scaling or optimizer._scaling()
    if state.driver is not None:
        raise RuntimeError(
            f"{method}() on an optimizer stepped by a {state.driver}, which owns its scale: "
            "step it with scaler.step(opt) (scaler.unscale_(opt) first to clip) and end the "
            "iteration with scaler.update()"
        )
    return state


def check_can_unscale(
    state: Any, grads_scaled_by: Tensor | float | None, reporter: int
) -> None:
    """Refuses a second unscale before a step, and ``grads_scaled_by=None`` (nothing to unscale
    or skip) after a backward scaled by ``opt.scale``, whose grads are scaled."""
    if state.pending is not None and state.pending.retry is None:  # (a retry: Note [atomic step])
        raise RuntimeError(
            "unscale() was already called since the last step (or a step failed after it had "
            "unscaled the grads in place, or updated a param group): the step is pending. Call "
            "step_after_unscale() (or zero_grad() and a new backward) first."
        )
    if grads_scaled_by is None and state.loss_scale.scaled_for(reporter):
        raise RuntimeError(
            "grads_scaled_by=None says the grads are not scaled, but they come from a "
            "backward scaled by opt.scale (scaledoptim.scale_outputs(loss, opt.scale)): pass "
            "grads_scaled_by=opt.scale, or scale the loss by None for unscaled training"
        )


def check_closure_free(optimizer: Any, method: str) -> None:
    """LBFGS cannot step without its closure."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise RuntimeError(
            f"LBFGS evaluates a closure on every step, so {method}() needs one: "
            "opt.unscale_and_step(closure, grads_scaled_by=S) with closure(S) -> loss"
        )


# ---------------------------------------------------------------------------------- the stages
def plan(optimizer: Any, run: Callable[[], Any] | None = None) -> StepPlan:
    """The step's plan: the kept one, re-verified and bound to this step's grads (Note [step
    cache] in fused/plan.py), or, when anything it rests on changed, ``optimizer._plan_step``'s
    (a generic optimizer's runs ``run``, its step, as the update)."""
    kept = optimizer._step_cache
    if kept is not None:
        renewed = kept.renew(optimizer)
        if renewed is not None:
            return renewed
    return optimizer._plan_step(run)


def check(
    plan: StepPlan,
    state: Any,
    request: Request,
    backward_check: Any,
    unscaled: list[list[Tensor]] | None = None,
) -> GradPass:
    """The first read of the grads: ``found_inf`` (adding to the request's, and to what
    ``check_during_backward`` folded), and the sum of squares when clipping. What it unscales
    in place goes into ``unscaled`` (Note [atomic step])."""
    if request.pending is not None:
        return request.pending
    scaled_by, clip = request.scaled_by, request.max_grad_norm is not None
    if scaled_by is None and not clip and request.found_inf is None:
        return UNCHECKED  # nothing to unscale, skip or clip
    if scaled_by is not None and isinstance(plan, GenericStepPlan):  # unscaled in place
        check_fp16_unscale(plan.optimizer, plan, "a scaled step")
    device = state.loss_scale.scale.device
    checked: frozenset[int] = frozenset()
    if backward_check is not None and scaled_by is not None:
        found_inf, checked = backward_check.take(plan.params, device, scaled_by)
    else:
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if request.found_inf is not None:
        found_inf = torch.maximum(found_inf, request.found_inf)
    if scaled_by is None and not clip:  # a flag to skip on, the grads unscaled already
        return GradPass(found_inf)
    # As GradScaler computes it. Grads not scaled are checked into a flag of their own when
    # they are clipped: nothing skips their step.
    inv_scale = scaled_by.double().reciprocal().float() if scaled_by is not None else None
    flag = found_inf if scaled_by is not None else torch.zeros_like(found_inf)
    unscaled = [] if unscaled is None else unscaled
    if not clip:
        grads = plan.check(flag, inv_scale, checked, None, unscaled)
        return GradPass(found_inf, True, inv_scale, grads)
    # See Note [clipping in the step] in clipping.py: the sum of squares of every grad.
    norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    if inv_scale is None:
        inv_scale = torch.ones_like(found_inf)
    grads = plan.check(flag, inv_scale, checked, norm_sq, unscaled)
    return GradPass(found_inf, scaled_by is not None, inv_scale, grads, norm_sq)


def decide(
    plan: StepPlan, state: Any, request: Request, grad_pass: GradPass, reporter: int
) -> GradPass:
    """What the update and the commit will do: ``found_inf`` agreed over ``process_group``, the
    clip factor from the agreed sum of squares, the scale's next value. Changes only the grads
    an in-place clip multiplies (Note [clipping in the step] in clipping.py)."""
    found_inf = grad_pass.found_inf
    if request.pending is not None or found_inf is None:
        return grad_pass
    if request.scaled_by is not None and state.process_group is not None:
        try:
            agree_on_found_inf(found_inf, state.process_group)
        except BaseException:
            found_inf.fill_(1.0)  # this rank cannot know whether another overflowed: skip
            raise
    if grad_pass.sum_of_squares is not None and request.max_grad_norm is not None:
        group = state.process_group if request.sums_over_group else None
        norm, coef = norm_and_coefficient(grad_pass.sum_of_squares, request.max_grad_norm, group)
        grad_pass = dataclasses.replace(plan.clip(grad_pass, coef), norm=norm)
    if not request.moves_scale or request.scaled_by is None:
        return grad_pass
    loss_scale = state.loss_scale
    if loss_scale.sharers == 1:  # an unshared scale moves at its own report
        move = ScaleUpdate(loss_scale, request.scaled_by, found_inf, state.replaying)
    else:
        move = loss_scale.round_move(
            reporter, request.scaled_by, found_inf, force_backoff=state.replaying
        )
    return dataclasses.replace(grad_pass, scale_update=move, report=True)


def commit(optimizer: Any, plan: StepPlan, request: Request, grad_pass: GradPass) -> None:
    """The step ran: new state, counters and the scale's move (the plan's), the report to the
    scale, ``grad_norm``, a GradScaler's scale adopted; nothing is pending any more."""
    plan.commit(grad_pass)
    state = optimizer._scaledoptim_scaling
    if grad_pass.report:
        record_report(state.loss_scale, id(optimizer), grad_pass.found_inf)
    if grad_pass.norm is not None:
        optimizer._scaledoptim_grad_norm = grad_pass.norm
    if request.adopt is not None:
        adopt_scale(optimizer, *request.adopt)
    if state is not None:
        state.pending = None


# ---------------------------------------------------------------------------------- the forms
@compile_boundary.disable  # See Note [compile boundary] in optimizer.py
@torch.no_grad()
def planned_step(optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
    """Performs a single optimization step, the update planned by the protocol (a
    :class:`~scaledoptim.FusedOptimizer`'s ``step``): as ``step_after_unscale()`` after
    ``unscale()``, as ``unscale_and_step()`` after a backward scaled by ``opt.scale``, else as
    torch.optim's. No host read, but one to skip params that take torch.optim's own
    implementation (as torch.amp.GradScaler reads for it).

    Args:
        closure: optional, re-evaluates the model and returns the loss.
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    # See Note [step requests] in guard.py: what the protocol asks of this step is planned here,
    # after the step pre-hooks, so that what they did to the grads is what is checked and used.
    request, optimizer._scaledoptim_request = optimizer._scaledoptim_request, None
    if request is None:
        request = optimizer._implicit_request(closure is not None) or PLAIN
    # See Note [atomic step]: a step whose update ran in part is rolled forward on its plan.
    partial = request.pending.partial if request.pending is not None else None
    optimizer._scaledoptim_outcome = run(optimizer, request, partial or plan(optimizer))[1]
    return loss


def run_step(optimizer: Any, request: Request, *args: Any, **kwargs: Any) -> tuple[Any, GradPass]:
    """Runs ``optimizer.step(*args, **kwargs)`` carrying ``request`` out (Note [step requests]
    in guard.py); returns what the step returned (``None`` for a step skipped on the host) and
    its pass. :class:`scaledoptim.GradScaler` steps an optimizer through it."""
    if not optimizer._plans_in_step:
        run_update = functools.partial(optimizer.step, *args, **kwargs) if args or kwargs else None
        return run(optimizer, request, plan(optimizer, run_update))
    # step() takes no request and returns the loss: the request and its pass go through these
    # two slots, each read once.
    optimizer._scaledoptim_request, optimizer._scaledoptim_outcome = request, None
    try:
        result, outcome = optimizer.step(*args, **kwargs), optimizer._scaledoptim_outcome
    finally:
        optimizer._scaledoptim_request = optimizer._scaledoptim_outcome = None
    if outcome is None:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() did not run the step the protocol asked for: a "
            "subclass of FusedOptimizer that overrides step() must call super().step()"
        )
    return result, outcome


def run(optimizer: Any, request: Request, plan: StepPlan) -> tuple[Any, GradPass]:
    """Checks, decides, updates and commits ``plan`` as ``request`` asks; returns what the
    update returned and the pass (Note [atomic step] for what a failure leaves)."""
    state = optimizer._scaledoptim_scaling
    request = retried(state, request)
    # What the check unscales in place, as it goes (and what a failed try did: a retry).
    unscaled = UnscaledBefore(request.unscaled) if request.unscaled else []
    grad_pass = decided = None
    try:
        grad_pass = check(plan, state, request, optimizer._scaledoptim_backward_check, unscaled)
        decided = decide(plan, state, request, grad_pass, id(optimizer))
        optimizer._scaledoptim_stepping = True  # a plan that calls self.step() is let through
        try:
            result = plan.update(decided)
        finally:
            optimizer._scaledoptim_stepping = False
    except BaseException:
        if request.pending is None:
            state.pending = left_pending(plan, request, grad_pass, decided, unscaled)
        raise
    commit(optimizer, plan, request, decided)
    return result, decided


def retried(state: Any, request: Request) -> Request:
    """``request`` with the record of a check that failed part way, if one is pending (Note
    [atomic step]): for ``step_after_unscale()``, the failed request itself."""
    retry = state.pending.retry if state is not None and state.pending is not None else None
    if retry is None:
        return request
    if request.pending is not None:
        return retry
    if retry.scaled_by is not request.scaled_by and (
        retry.scaled_by is None
        or request.scaled_by is None
        or not torch.equal(retry.scaled_by, request.scaled_by)  # (a read on a failure's retry)
    ):
        raise RuntimeError(
            "A step failed after unscaling some grads in place by its grads_scaled_by: pass the "
            "same one (or call step_after_unscale(), or zero_grad() and a new backward)"
        )
    return dataclasses.replace(request, unscaled=retry.unscaled)


def left_pending(
    plan: StepPlan, request: Request, grad_pass: GradPass | None, decided: GradPass | None,
    unscaled: list[list[Tensor]],
) -> GradPass | None:
    """What a step that failed leaves pending (Note [atomic step]): ``None`` when no grad the
    user holds was written, nothing ran, and the same call again is the recovery."""
    if grad_pass is None:  # the check failed: the request again, knowing what it unscaled
        retry = dataclasses.replace(request, unscaled=tuple(unscaled))
        return GradPass(None, retry=retry) if unscaled else None
    if grad_pass.found_inf is None:
        return None
    if decided is None:  # no decision: skip (see Note [atomic step])
        grad_pass.found_inf.fill_(1.0)
    return plan.settle(decided if decided is not None else grad_pass)


def check_fp16_unscale(optimizer: Any, plan: StepPlan, method: str) -> None:
    """Refuses scaled fp16 grads ``method`` would unscale in place (``validation.py``): the split
    form's, and every scaled step's of a generic plan, whose update (the optimizer's own
    ``step()``) reads the grads the check unscaled in place."""
    generic = isinstance(plan, GenericStepPlan)
    check_no_fp16_grads(plan.grads, method, type(optimizer).__name__ if generic else None)


def record_report(loss_scale: LossScale, reporter: int, found_inf: Tensor | None) -> None:
    if loss_scale.sharers == 1:
        loss_scale.handle["scaled"] = False  # the scale moved for the scaled backward
    else:
        assert found_inf is not None
        loss_scale.record_report(reporter, found_inf)
