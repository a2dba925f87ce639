"""The split form of :class:`scaledoptim.Optimizer`'s protocol: :meth:`~Optimizer.unscale`, then
:meth:`~Optimizer.step_after_unscale` (Note [step requests] in optimizer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import compile_boundary
from ..torch_ops import unscale_in_place_
from . import replay
from .plans import GenericStepPlan, StepOutcome, StepRequest
from .unscaling import UnscalePlanner
from .validation import check_no_fp16_grads


class SplitForm(UnscalePlanner):
    """The split-form half of :class:`scaledoptim.Optimizer`. Not used on its own."""

    if TYPE_CHECKING:  # defined by scaledoptim.Optimizer, next to the per-step protocol

        def _run_step(
            self, request: StepRequest, *args: Any, **kwargs: Any
        ) -> tuple[Any, StepOutcome | None]: ...

    # Note [compile boundary]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # The protocol's Python (stage, plans, tables, host reads of a
    # closure replay) is not traceable; torch.compile runs it eagerly and compiles around it.
    @compile_boundary.disable
    @torch.no_grad()
    def unscale(
        self, grads_scaled_by: torch.Tensor | float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""Divides every grad by ``grads_scaled_by`` in place and checks them for inf/nan.

        Records ``found_inf`` for the next :meth:`step_after_unscale` and moves the scale: back
        off on overflow, grow after ``growth_interval`` clean steps. No host sync when
        ``grads_scaled_by`` is ``opt.scale`` or a Python float.

        Args:
            grads_scaled_by: the scale the loss was multiplied by, or ``None`` when the grads
                are not scaled (nothing is unscaled, nothing will be skipped).

        Returns:
            ``(found_inf, recommended_scale)``: ``found_inf`` is a 0-dim float32 tensor (1.0 if
            any grad was inf/nan); ``recommended_scale`` is
            :attr:`~scaledoptim.Optimizer.scale` (``None`` if ``grads_scaled_by`` was ``None``).

        A plain ``step()`` after it honours ``found_inf`` as :meth:`step_after_unscale` does.

        fp16 grads are refused, as :meth:`torch.amp.GradScaler.unscale_` refuses them: unscaled
        in place they cannot hold small grads (below fp16's 6e-8 they flush to zero), and a
        clipped run drifts from fp32. :meth:`~scaledoptim.Optimizer.unscale_and_step` unscales
        them in fp32 inside the update, and clips them there with ``max_grad_norm``; or keep fp32
        params under autocast. bf16 grads have float32's range and are unscaled in place.

        Raises:
            RuntimeError: if called twice without a step (or ``zero_grad``) in between, for
                sparse grads, grads on another device than the scale, a scale tensor that is no
                longer in use (see "S = opt.scale stays the scale in use" in the concepts
                guide), ``grads_scaled_by=None`` after a backward
                scaled by :attr:`~scaledoptim.Optimizer.scale`, or an optimizer a
                :class:`scaledoptim.GradScaler` steps.
            ValueError: if the scale is not finite and positive, or for fp16 grads.
        """
        self._check_own_protocol("unscale")
        self._check_can_unscale()
        self._check_told_unscaled(grads_scaled_by)
        step = self._plan_step()  # the step it prepares must be possible too
        if grads_scaled_by is not None and not isinstance(step, GenericStepPlan):
            check_no_fp16_grads(step.grads, "unscale()")  # a generic step's: in _plan_unscale
        plan = self._plan_unscale(grads_scaled_by, step)
        if plan.inv_scale is not None:
            unscale_in_place_(step.grads, plan.found_inf, plan.inv_scale)
        found_inf, scale, _ = self._record_unscale(plan)
        return found_inf, scale

    @compile_boundary.disable  # See Note [compile boundary]
    def step_after_unscale(
        self,
        closure: Callable[[Any], tuple[Any, torch.Tensor, Any]] | None = None,
        current_grad_scale: torch.Tensor | float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None] | None:
        r"""Steps with the grads :meth:`unscale` left, skipping the step if it found inf/nan.

        Without a closure: consumes the ``found_inf`` recorded by :meth:`unscale` and returns
        ``None``. Fused optimizers skip on device; a generic ``step()`` costs one host read.

        With a closure: ``closure(S)`` must zero the grads, run the forward and a backward
        scaled by ``S``, call ``opt.unscale(grads_scaled_by=S)`` itself (so it can clip or
        inspect the grads) and return ``(loss, found_inf, S)`` as :meth:`unscale` gave them. It
        is replayed with the backed-off ``S`` until its grads are finite (one host read per
        call), and ``self.step`` only ever sees finite grads.

        Args:
            closure: optional, see above.
            current_grad_scale: the scale passed to the closure's first call.

        Returns:
            ``None`` without a closure; ``(loss, found_inf, S)`` with one.

        Raises:
            RuntimeError: without a closure, if :meth:`unscale` was not called first.
            ClosureReplayError: if the closure's grads stay non-finite; nothing is changed.
        """
        self._check_own_protocol("step_after_unscale")
        if closure is not None:
            replay.check_callable(closure, "step_after_unscale", "current_grad_scale")
            replay.check_takes_scale(closure, "step_after_unscale")
            return replay.step_replaying(
                self, lambda scale: replay.checked_result(self, closure(scale)), current_grad_scale
            )
        state = self._scaling()
        if state.found_inf is None:
            raise RuntimeError(
                "step_after_unscale() needs the grads unscaled first: call "
                "opt.unscale(grads_scaled_by=S) after backward, or use opt.unscale_and_step()."
            )
        self._check_can_step_without_closure("step_after_unscale")
        # The step plans again, not with unscale()'s plan: code between the two calls may have
        # changed anything a plan rests on (``p.data = ...``, ``p.grad = other``, a state
        # tensor, an option), and no cheaper signal covers all of it (``.data =`` moves no
        # version counter: a storage is seen only through its pointer). A fused step's check
        # is the step cache's with the grads unmoved, so it repoints nothing
        # (Note [step cache] in fused/cache.py).
        self._run_step(StepRequest(unscale=False, found_inf=state.found_inf))
        return None
