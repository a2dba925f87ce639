"""The guard around a plain ``step()``: it never applies scaled grads or steps past an overflow.

:class:`PlainStepGuard` wraps the ``step`` of every :class:`~scaledoptim.Optimizer` subclass
whose update the protocol does not own, and asks what a plain ``step()`` call owes the protocol
(Note [step requests] in optimizer.py). Its only caller is ``step()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .ownership import ScaleOwner, ScalingState
from .plans import StepOutcome, StepRequest
from .torch_scaler_interop import torch_scaler_request

__all__ = ["PlainStepGuard"]


class PlainStepGuard(ScaleOwner):
    """The plain-``step()`` half of :class:`scaledoptim.Optimizer`. Not used on its own."""

    #: Whether ``step()`` receives the protocol's :class:`StepRequest` and plans the step
    #: itself, after the step pre-hooks (the fused optimizers); otherwise the protocol plans
    #: first and a guard wraps ``step`` (Note [step requests]).
    _plans_in_step: ClassVar[bool] = False
    #: Set while the protocol itself runs ``step()``: the guard lets that call through.
    _scaledoptim_stepping: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wraps a subclass's own ``step`` in the protocol's guard (so that a plain ``step()``
        never applies scaled grads or steps past an overflow), and
        in torch's step hooks and profiler record, so that instances given the class by
        :func:`~scaledoptim.patch_optimizer` (whose ``__init__`` has run) get them too."""
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("step")
        if step is None or cls._plans_in_step or getattr(step, "_scaledoptim_guarded", False):
            return
        if getattr(step, "hooked", False):  # already wrapped by torch's hooks: wrap inside them
            step = step.__wrapped__
        guarded = _guard(step)
        hooked = torch.optim.Optimizer.profile_hook_step(guarded)
        hooked.hooked = True  # type: ignore[attr-defined]  # torch's flag: do not wrap again
        hooked._scaledoptim_guarded = True  # type: ignore[attr-defined]
        cls.step = hooked  # type: ignore[method-assign]

    if TYPE_CHECKING:  # defined by scaledoptim.Optimizer, next to the per-step protocol

        def _execute(
            self, request: StepRequest, run: Callable[[], Any] | None = None
        ) -> tuple[Any, StepOutcome]: ...

    def _implicit_request(self, closure_given: bool) -> StepRequest | None:
        """What a plain ``step()`` call owes the protocol (Note [step requests]), ``None`` for
        nothing: the step runs as written."""
        if "found_inf" in vars(self):  # set by torch.amp.GradScaler.step()
            return torch_scaler_request(self)
        state = self._scaledoptim_scaling
        if state is None or state.replaying:  # closure replay steps with what it unscaled
            return None
        if state.found_inf is not None:  # after unscale(): as step_after_unscale()
            return StepRequest(unscale=False, found_inf=state.found_inf)
        if not state.loss_scale.scaled_for(id(self)):
            return None
        if state.driver is not None:
            raise RuntimeError(
                f"{type(self).__name__}.step() after a backward scaled by its {state.driver}'s "
                "scale: step with scaler.step(opt) and end the iteration with scaler.update(), "
                "or the scaled grads would be applied as they are"
            )
        if closure_given:
            raise RuntimeError(
                f"{type(self).__name__}.step(closure) after a backward scaled by opt.scale: a "
                "plain step would apply the scaled grads. Use "
                "opt.unscale_and_step(closure, grads_scaled_by=opt.scale) with closure(S), "
                "which unscales every evaluation and replays it on overflow"
            )
        # The GradScaler habit, scale_outputs(loss, S).backward(); opt.step(): the grads are
        # scaled by opt.scale, so the step does what unscale_and_step(grads_scaled_by=S) does.
        return StepRequest(unscale=True, scaled_by=state.loss_scale.scale)

    def _guarded_step(
        self, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The guard around a generic ``step`` (Note [step requests])."""
        if self._scaledoptim_stepping:
            return step(self, *args, **kwargs)
        closure = kwargs["closure"] if "closure" in kwargs else (args[0] if args else None)
        request = self._implicit_request(closure is not None)
        if request is None:
            state = self._scaledoptim_scaling
            if closure is not None and state is not None and not state.replaying:
                args, kwargs = _with_closure(args, kwargs, self._checked_closure(closure, state))
            return step(self, *args, **kwargs)
        # torch's grad_scale/found_inf are ours to honour: the wrapped step must not see them.
        hidden: dict[str, Any] = {
            key: vars(self).pop(key) for key in ("grad_scale", "found_inf") if key in vars(self)
        }
        try:
            return self._execute(request, run=functools.partial(step, self, *args, **kwargs))[0]
        finally:
            vars(self).update(hidden)

    def _checked_closure(
        self, closure: Callable[[], Any], state: ScalingState
    ) -> Callable[[], Any]:
        """``closure``, refusing to let ``step`` use grads of a backward scaled by ``opt.scale``."""

        def checked() -> Any:
            loss = closure()
            if state.loss_scale.scaled_for(id(self)) and state.found_inf is None:
                raise RuntimeError(
                    f"{type(self).__name__}.step(closure) with a closure whose backward is "
                    "scaled by opt.scale: the step would use scaled grads. Use "
                    "opt.unscale_and_step(closure, grads_scaled_by=opt.scale) with closure(S), "
                    "which unscales every evaluation and replays it on overflow"
                )
            return loss

        return checked


def _guard(step: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's ``step`` inside the protocol's guard (Note [step requests])."""

    @functools.wraps(step, updated=())  # not torch's "hooked" flag of a hooked step
    def guarded(self: PlainStepGuard, *args: Any, **kwargs: Any) -> Any:
        return self._guarded_step(step, args, kwargs)

    return guarded


def _with_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (closure, *args[1:]), kwargs
