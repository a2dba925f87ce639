"""What a plain ``step()`` owes the protocol, and the guard that makes a generic ``step()`` honour
it: after ``unscale()``, the pending step; after a backward scaled by ``opt.scale``, an unscale;
under ``torch.amp.GradScaler.step()``, its ``grad_scale`` and ``found_inf`` (Note [torch
GradScaler]).

Note [step requests]
~~~~~~~~~~~~~~~~~~~~
Every protocol step goes through ``self.step()``, and ``step()`` itself honours the protocol:

* A protocol method hands the step it wants to ``step()`` as a ``steps.Request``. An optimizer
  whose update the protocol plans (``Optimizer._plans_in_step``: the fused ones, whose ``step()``
  is ``Optimizer.step``) receives it in ``step()`` and plans there, *after* the step pre-hooks
  ran, so what a hook does to the grads (assigned, zeroed in place) is what the plan validates,
  checks and uses. Any other optimizer is planned, unscaled and read on the host first, and its
  ``step()`` runs only when not skipped (torch.amp.GradScaler's order; the hooks see unscaled
  grads).
* A plain ``step()`` call asks :func:`implicit_request` what the protocol owes it: after
  ``unscale()``, the pending step (``step_after_unscale``); after a backward scaled by
  ``opt.scale`` (Note [scale handles] in scale/loss_scale.py), an unscale
  (``unscale_and_step``); with ``grad_scale``/``found_inf`` set by ``torch.amp.GradScaler``,
  those. So the GradScaler habits ``scale_outputs(loss, S).backward(); opt.step()`` and
  ``opt.unscale(...); opt.step()`` never step on scaled grads or past an overflow. Every other
  subclass's ``step`` is wrapped by ``Optimizer.__init_subclass__`` (and ``with_scaling``) in
  :func:`guard`, which does it around the step it wraps. The protocol's own calls of ``step()``
  set ``_scaledoptim_stepping``, which the guard lets through.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from . import steps
from .plans import native_amp_scaling
from .user_frames import user_stacklevel
from .values import GradPass, Request

__all__ = ["AMP_SCALING", "guard", "implicit_request", "wrap_step"]


def implicit_request(optimizer: Any, closure_given: bool) -> Request | None:
    """What a plain ``step()`` call owes the protocol (Note [step requests]), ``None`` for
    nothing: the step runs as written."""
    if "found_inf" in vars(optimizer):  # set by torch.amp.GradScaler.step()
        return _torch_scaler_request(optimizer)
    state = optimizer._scaledoptim_scaling
    if state is None:
        return None
    if state.replaying:  # closure replay: the evaluation a fused step's closure checked
        planned = optimizer._plans_in_step and state.pending is not None
        return Request(pending=state.pending) if planned else None
    if state.pending is not None:  # after unscale(): as step_after_unscale()
        return Request(pending=state.pending)
    if not state.loss_scale.scaled_for(id(optimizer)):
        return None
    name = type(optimizer).__name__
    if state.driver is not None:
        raise RuntimeError(
            f"{name}.step() after a backward scaled by its {state.driver}'s scale: step with "
            "scaler.step(opt) and end the iteration with scaler.update(), or the scaled grads "
            "would be applied as they are"
        )
    if closure_given:
        raise RuntimeError(
            f"{name}.step(closure) after a backward scaled by opt.scale: a plain step would "
            "apply the scaled grads. Use opt.unscale_and_step(closure, grads_scaled_by=opt.scale) "
            "with closure(S), which unscales every evaluation and replays it on overflow"
        )
    # The GradScaler habit, scale_outputs(loss, S).backward(); opt.step(): the grads are scaled
    # by opt.scale, so the step does what unscale_and_step(grads_scaled_by=S) does.
    return steps.validate_request(optimizer, state, state.loss_scale.scale)


def wrap_step(cls: type[Any]) -> None:
    """Wraps ``cls``'s own ``step`` (if it defines one and the protocol does not plan its
    update) in :func:`guard`, inside torch's step hooks and profiler record, so that instances
    given the class by ``patch_optimizer`` (whose ``__init__`` has run) get them too."""
    step = cls.__dict__.get("step")
    if step is None or cls._plans_in_step or getattr(step, "_scaledoptim_guarded", False):
        return
    if getattr(step, "hooked", False):  # already wrapped by torch's hooks: wrap inside them
        step = step.__wrapped__
    cls.step = guard(step)


def guard(step: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's ``step`` inside the protocol's guard, within torch's step hooks and profiler
    record (Note [step requests])."""

    @functools.wraps(step, updated=())  # not torch's "hooked" flag of a hooked step
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._scaledoptim_stepping:  # the protocol's own call
            return step(self, *args, **kwargs)
        closure = kwargs["closure"] if "closure" in kwargs else (args[0] if args else None)
        request = implicit_request(self, closure is not None)
        if request is None:
            state = self._scaledoptim_scaling
            if closure is not None and state is not None and not state.replaying:
                args, kwargs = _with_closure(args, kwargs, _checked_closure(self, closure))
            return step(self, *args, **kwargs)
        # torch's grad_scale/found_inf are ours to honour: the wrapped step must not see them.
        hidden = {k: vars(self).pop(k) for k in ("grad_scale", "found_inf") if k in vars(self)}
        try:
            run = functools.partial(step, self, *args, **kwargs)
            return steps.run(self, request, steps.plan(self, run))[0]
        finally:
            vars(self).update(hidden)

    hooked = torch.optim.Optimizer.profile_hook_step(guarded)
    hooked.hooked = True  # type: ignore[attr-defined]  # torch's flag: do not wrap again
    hooked._scaledoptim_guarded = True  # type: ignore[attr-defined]
    return hooked


def _checked_closure(optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """``closure``, refusing to let ``step`` use grads of a backward scaled by ``opt.scale``."""
    state = optimizer._scaledoptim_scaling

    def checked() -> Any:
        loss = closure()
        if state.loss_scale.scaled_for(id(optimizer)) and state.pending is None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(closure) with a closure whose backward is "
                "scaled by opt.scale: the step would use scaled grads. Use "
                "opt.unscale_and_step(closure, grads_scaled_by=opt.scale) with closure(S), which "
                "unscales every evaluation and replays it on overflow"
            )
        return loss

    return checked


def _with_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (closure, *args[1:]), kwargs


# ----------------------------------------------------------------------- torch.amp.GradScaler
def _torch_scaler_request(optimizer: Any) -> Request | None:
    """The step ``torch.amp.GradScaler.step()`` asks for by setting ``grad_scale`` and
    ``found_inf`` on the optimizer (Note [torch GradScaler]); ``None`` when the optimizer's own
    step reads them (torch's fused optimizers)."""
    attrs = vars(optimizer)
    if not optimizer._scaledoptim_warned_torch_scaler:
        optimizer._scaledoptim_warned_torch_scaler = True
        warnings.warn(
            f"A torch.amp.GradScaler steps this scaledoptim.{type(optimizer).__name__}: the scaler "
            "keeps a scale of its own, so opt.scale (and the 'loss_scale' saved in "
            "opt.state_dict()) is not the scale in use. The steps are right (they skip on "
            "the scaler's found_inf), but use scaledoptim.GradScaler, a drop-in with the "
            "same API whose scale is opt.scale, or the optimizer's own protocol "
            "(opt.unscale_and_step(grads_scaled_by=opt.scale)).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if native_amp_scaling(optimizer):
        return None  # torch's fused step reads grad_scale and found_inf itself
    grad_scale, found_inf = attrs.get("grad_scale"), attrs["found_inf"]
    if grad_scale is None:  # after the scaler's unscale_(): skip on what it found
        return Request(pending=GradPass(found_inf))
    device = optimizer._scaling().loss_scale.device
    scaled_by = grad_scale.to(device, torch.float32, non_blocking=True)
    return Request(scaled_by, found_inf=found_inf, moves_scale=False)


def _asked_by_torch_scaler(optimizer: Any) -> bool:
    """``optimizer._step_supports_amp_scaling`` as its reader gets it (Note [torch GradScaler]):
    true for torch's fused optimizers, and for a scaledoptim one only when
    ``torch.amp.GradScaler.step`` asks. The getter of :data:`AMP_SCALING` alone: it reads the
    frame that read the property."""
    if native_amp_scaling(optimizer):
        return True
    # Frame 0 is this getter, 1 whoever read the property.
    return sys._getframe(1).f_code in _torch_scaler_steps()


def _set_amp_scaling(optimizer: Any, value: bool) -> None:
    vars(optimizer)["_step_supports_amp_scaling"] = value  # torch's fused __init__ sets it


#: ``Optimizer._step_supports_amp_scaling``, torch's flag for "my step() reads ``grad_scale``
#: and ``found_inf``" (Note [torch GradScaler]).
AMP_SCALING = property(_asked_by_torch_scaler, _set_amp_scaling)


@functools.cache
def _torch_scaler_steps() -> frozenset[CodeType]:
    """The code of ``torch.amp.GradScaler.step`` (and subclasses' own ``step``) that asks
    ``_step_supports_amp_scaling`` before stepping.

    Note [torch GradScaler]
    ~~~~~~~~~~~~~~~~~~~~~~~
    ``torch.amp.GradScaler.step(opt)`` asks ``opt._step_supports_amp_scaling``; when it is true
    it sets ``opt.grad_scale`` (``None`` after ``unscale_``) and ``opt.found_inf`` (on device)
    and calls ``opt.step()``, which must unscale and skip itself. scaledoptim's optimizers answer
    true to that call alone: their step then honours both on device (sync-free on the fused
    ones) and warns once that ``opt.scale`` is not the scale in use. Anyone else asking (Lightning
    decides from it that the optimizer "unscales internally" and refuses gradient clipping) gets
    false, which is what a scaledoptim optimizer's plain ``step()`` is. torch's own fused
    optimizers set the flag on the instance; they answer true to everyone, as in torch.
    """
    codes = {torch.amp.GradScaler.step.__code__}
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:  # torch built without distributed
        pass
    else:
        if "step" in vars(ShardedGradScaler):
            codes.add(ShardedGradScaler.step.__code__)
    return frozenset(codes)
