"""Closure replay: a closure whose grads overflow is run again with the backed-off scale.

Each evaluation runs the pipeline's stages (``steps.py``): a fused optimizer's is checked and
decided as ``unscale_and_step`` checks a step without a closure (its update unscales in fp32, so
fp16 grads work), and the finite one is left pending for the ``step()`` it runs in to update and
commit; any other optimizer's is unscaled in place (:func:`split_form.unscale`), as the
optimizer may read the grads many times (LBFGS). Replays are bounded (``max_replays``, and never
below ``min_scale``). Params, optimizer state and the scale are snapshotted first and restored
bit for bit if replay fails or the closure raises.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from . import steps
from .clipping import clip_in_place_, norm_and_coefficient, sum_of_squares

__all__ = [
    "ClosureReplayError",
    "check_callable",
    "step_after_unscale",
    "takes_scale",
    "unscale_and_step",
]

Evaluation = tuple[Any, torch.Tensor, "torch.Tensor | None"]


class ClosureReplayError(RuntimeError):
    """A closure kept producing non-finite grads after every allowed replay.

    When it is raised, params, optimizer state and the loss scale are exactly as they were before
    the call that raised it.
    """


def unscale_and_step(
    optimizer: Any,
    closure: Callable[..., Any],
    grads_scaled_by: torch.Tensor | float | None,
    max_grad_norm: Any,
) -> Evaluation:
    """``optimizer.unscale_and_step(closure, ...)``: every evaluation checked (unscaled, clipped)
    and replayed on overflow; returns ``(loss, found_inf, S)``."""
    check_callable(closure, "unscale_and_step", "grads_scaled_by")
    state = optimizer._scaling()
    clip = steps.validate_request(optimizer, state, None, max_grad_norm)  # before any change
    if grads_scaled_by is None:
        # A torch-style closure() (LBFGS code being migrated) steps as torch runs it.
        run = closure if not takes_scale(closure) else lambda: closure(None)

        def unscaled() -> Any:  # the closure (its grads unscaled), then the clip, at every call
            loss = run()
            if clip.max_grad_norm is not None:
                _clip_unscaled(optimizer, clip)
            return loss

        loss = optimizer.step(unscaled)
        return loss, torch.zeros((), dtype=torch.float32, device=state.loss_scale.device), None
    _check_takes_scale(closure, "unscale_and_step")
    if optimizer._plans_in_step:

        def evaluate(scale: Any) -> Evaluation:
            loss = closure(scale)
            request = steps.validate_request(optimizer, state, scale, max_grad_norm)
            plan = steps.plan(optimizer)
            grad_pass = steps.check(plan, state, request, optimizer._scaledoptim_backward_check)
            grad_pass = steps.decide(plan, state, request, grad_pass, id(optimizer))
            assert grad_pass.found_inf is not None  # a scale was given
            if grad_pass.found_inf.item() != 0.0:  # replayed: the backoff is committed now
                steps.commit(optimizer, plan, steps.PLAIN, grad_pass)
            else:  # the step this evaluation runs in updates and commits it
                state.pending = grad_pass
            return loss, grad_pass.found_inf, state.loss_scale.scale

    else:

        def evaluate(scale: Any) -> Evaluation:
            loss = closure(scale)
            found_inf, next_scale = optimizer.unscale(grads_scaled_by=scale)
            if clip.max_grad_norm is not None:  # the grads are unscaled in place: clip them
                _clip_unscaled(optimizer, clip)
            return loss, found_inf, next_scale

    return _step_replaying(optimizer, evaluate, grads_scaled_by)


def step_after_unscale(
    optimizer: Any, closure: Callable[..., Any], first_scale: torch.Tensor | float | None
) -> Evaluation:
    """``optimizer.step_after_unscale(closure, ...)``: ``closure(S)`` unscales itself."""
    check_callable(closure, "step_after_unscale", "current_grad_scale")
    _check_takes_scale(closure, "step_after_unscale")

    def evaluate(scale: Any) -> Evaluation:
        result = closure(scale)
        if not (
            isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], torch.Tensor)
        ) or not optimizer._scaling().unscaled:
            raise TypeError(
                "A closure given to step_after_unscale() must call "
                "opt.unscale(grads_scaled_by=S) and return (loss, found_inf, S) as unscale() "
                f"returned them; got {type(result).__name__}. For a closure that only returns "
                "the loss, use unscale_and_step(closure, grads_scaled_by=S)."
            )
        return result

    return _step_replaying(optimizer, evaluate, first_scale)


def _step_replaying(
    optimizer: Any,
    evaluate: Callable[[Any], Evaluation],
    first_scale: torch.Tensor | float | None,
) -> Evaluation:
    """Runs ``optimizer.step(closure)`` where the closure calls ``evaluate(S)`` until its grads
    are finite, backing the scale off in between; returns ``(loss, found_inf, S)``."""
    state = optimizer._scaling()
    if state.pending is not None:
        raise RuntimeError(
            "The grads were unscaled before a closure step; a closure step computes its own "
            "grads. Drop the unscale() call or step with step_after_unscale() first."
        )
    if state.loss_scale.sharers > 1:
        raise RuntimeError(
            "Closure replay needs the optimizer's own loss scale, but this one is shared "
            "(scaledoptim.share_scale); give closure optimizers a scale of their own."
        )
    max_replays = state.loss_scale.config.max_replays
    outcome: dict[str, Any] = {}

    def replaying_closure() -> Any:
        scale = outcome.get("scale", first_scale)
        tries = 0
        while tries <= max_replays:
            tries += 1
            state.pending = None
            tried = None if scale is None else float(scale)  # the scale updates in place
            loss, found_inf, next_scale = evaluate(scale)
            if next_scale is None or found_inf.item() == 0.0:
                outcome.update(found_inf=found_inf, scale=next_scale)
                return loss
            next_value = next_scale.item()
            if tried == next_value:  # at min_scale: a replay would overflow again
                break
            scale = next_scale
        raise ClosureReplayError(
            f"The closure produced inf/nan grads on all {tries} tries (the scale backed "
            f"off to {next_value:g}): the loss itself is probably non-finite (check the data "
            "and the forward), or raise configure_scaling(max_replays=...) / lower "
            "min_scale. Params, optimizer state and the loss scale were restored."
        )

    snapshot = _snapshot(optimizer)
    state.replaying = True
    try:
        loss = optimizer.step(replaying_closure)
    except BaseException:
        _restore(optimizer, snapshot)
        raise
    finally:
        state.replaying = False
        state.pending = None
    return loss, outcome["found_inf"], outcome["scale"]


def check_callable(closure: Any, method: str, scale_keyword: str) -> None:
    """A scale passed positionally lands in ``closure``: say so instead of failing in step()."""
    if not callable(closure):
        raise TypeError(
            f"{method}() takes a closure(S) function or None as its first argument, got "
            f"{type(closure).__name__}; pass the scale by keyword: {method}({scale_keyword}=S)"
        )


def takes_scale(closure: Callable[..., Any]) -> bool:
    """Whether ``closure`` accepts one positional argument (the scale ``S``): a torch-style
    ``closure()`` does not. Callables whose signature Python cannot read are assumed to."""
    try:
        inspect.signature(closure).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): let the call itself decide
        return True
    return True


def _check_takes_scale(closure: Callable[..., Any], method: str) -> None:
    """A closure given with a scale must take it: say so before anything changes."""
    if not takes_scale(closure):
        raise TypeError(
            f"{method}() was given a scale, so its closure is called as closure(S) and must "
            "take the scale S to run its backward with (scaledoptim.scale_outputs(loss, S)."
            "backward()); this closure takes no argument. Add the parameter, or pass "
            "grads_scaled_by=None for an unscaled torch-style closure()."
        )


def _clip_unscaled(optimizer: Any, request: steps.Request) -> None:
    """Clips the grads, unscaled in place, as ``clip_grad_norm_`` does; keeps the norm in
    ``grad_norm`` (Note [clipping in the step] in clipping.py)."""
    assert request.max_grad_norm is not None
    state = optimizer._scaling()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    norm_sq = sum_of_squares(grads)
    group = state.process_group if request.sums_over_group else None
    norm, coef = norm_and_coefficient(norm_sq, request.max_grad_norm, group)
    optimizer._scaledoptim_grad_norm = norm
    clip_in_place_(grads, coef)


def _snapshot(optimizer: Any) -> tuple[list[torch.Tensor], dict[Any, Any], dict[str, Any]]:
    params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    opt_state = {p: copy.deepcopy(s) for p, s in optimizer.state.items()}
    return params, opt_state, optimizer._scaling().loss_scale.state_dict()


@torch.no_grad()
def _restore(
    optimizer: Any, snapshot: tuple[list[torch.Tensor], dict[Any, Any], dict[str, Any]]
) -> None:
    params, opt_state, scale_state = snapshot
    for param, saved in zip((p for g in optimizer.param_groups for p in g["params"]), params):
        param.copy_(saved)
    optimizer.state.clear()
    optimizer.state.update(opt_state)
    loss_scale = optimizer._scaling().loss_scale
    for name in ("scale", "growth_tracker", "hysteresis_tracker"):
        getattr(loss_scale, name).copy_(scale_state[name])
