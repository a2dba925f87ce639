"""Closure replay: a closure whose grads overflow is run again with the backed-off scale.

Replays are bounded (``max_replays``, and never below ``min_scale``). Params, optimizer state
and the scale are snapshotted first and restored bit for bit if replay fails or the closure
raises.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .ownership import ScalingState

__all__ = [
    "ClosureReplayError",
    "check_callable",
    "check_takes_scale",
    "checked_result",
    "step_replaying",
    "takes_scale",
]

Evaluation = tuple[Any, torch.Tensor, "torch.Tensor | None"]


class Replayable(Protocol):
    """What closure replay needs of an optimizer: its params and state (to restore them), its
    scale and protocol state, and ``step(closure)``."""

    param_groups: list[dict[str, Any]]
    state: Any

    def step(self, closure: Callable[[], Any]) -> Any: ...

    @property
    def scaling_state(self) -> ScalingState: ...


class ClosureReplayError(RuntimeError):
    """A closure kept producing non-finite grads after every allowed replay.

    When it is raised, params, optimizer state and the loss scale are exactly as they were before
    the call that raised it.
    """


def step_replaying(
    optimizer: Replayable,
    evaluate: Callable[[Any], Evaluation],
    first_scale: torch.Tensor | float | None,
) -> Evaluation:
    """Runs ``optimizer.step(closure)`` where the closure calls ``evaluate(S)`` until its grads
    are finite, backing the scale off in between; returns ``(loss, found_inf, S)``."""
    state = optimizer.scaling_state
    if state.found_inf is not None:
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
            state.found_inf = None
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
        state.found_inf = None
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


def check_takes_scale(closure: Callable[..., Any], method: str) -> None:
    """A closure given with a scale must take it: say so before anything changes."""
    if not takes_scale(closure):
        raise TypeError(
            f"{method}() was given a scale, so its closure is called as closure(S) and must "
            "take the scale S to run its backward with (scaledoptim.scale_outputs(loss, S)."
            "backward()); this closure takes no argument. Add the parameter, or pass "
            "grads_scaled_by=None for an unscaled torch-style closure()."
        )


def checked_result(optimizer: Replayable, result: Any) -> Evaluation:
    """The ``(loss, found_inf, S)`` a ``step_after_unscale`` closure must return, checked."""
    if not (
        isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], torch.Tensor)
    ) or optimizer.scaling_state.found_inf is None:
        raise TypeError(
            "A closure given to step_after_unscale() must call opt.unscale(grads_scaled_by=S) "
            "and return (loss, found_inf, S) as unscale() returned them; got "
            f"{type(result).__name__}. For a closure that only returns the loss, use "
            "unscale_and_step(closure, grads_scaled_by=S)."
        )
    return result


def _snapshot(optimizer: Replayable) -> tuple[list[torch.Tensor], dict[Any, Any], dict[str, Any]]:
    params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    opt_state = {p: copy.deepcopy(s) for p, s in optimizer.state.items()}
    return params, opt_state, optimizer.scaling_state.loss_scale.state_dict()


@torch.no_grad()
def _restore(
    optimizer: Replayable, snapshot: tuple[list[torch.Tensor], dict[Any, Any], dict[str, Any]]
) -> None:
    params, opt_state, scale_state = snapshot
    for param, saved in zip((p for g in optimizer.param_groups for p in g["params"]), params):
        param.copy_(saved)
    optimizer.state.clear()
    optimizer.state.update(opt_state)
    loss_scale = optimizer.scaling_state.loss_scale
    for name in ("scale", "growth_tracker", "hysteresis_tracker"):
        getattr(loss_scale, name).copy_(scale_state[name])
