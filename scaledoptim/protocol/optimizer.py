"""The loss-scaling protocol, inherited by every scaledoptim optimizer.

The base class owns the step sequence, the same for every optimizer:

1. plan: every check that can fail (the stage, the scale, param groups, grads, and whatever the
   step will need, which :meth:`Optimizer._plan_step` validates), before anything changes;
2. unscale the grads in place, or only check them when the update folds the unscale in;
3. agree on ``found_inf`` across the process group, record it and move the scale;
4. step, through ``self.step()`` so that hooks, schedulers and the profiler see a step.

A subclass answers one hook, :meth:`Optimizer._plan_step`; the fused optimizers answer it with
an update that skips on device (Note [found_inf contract] in cuda/common.cuh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..scale import LossScale, ScaleUpdate, ScalingConfig, agree_on_found_inf, as_scale_tensor
from ..torch_ops import refuse_during_capture, unscale_in_place_
from . import replay
from .ownership import ScaleOwner, ScalingState
from .plans import GenericStepPlan, PendingStep, StepPlan, UnscalePlan
from .replay import ClosureReplayError
from .validation import check_param_grads

__all__ = ["ClosureReplayError", "Optimizer"]

#: Options torch.optim's ``__setstate__`` (run by ``load_state_dict``) adds to the defaults of
#: every optimizer, but not to the groups of those that never had them (LBFGS, SparseAdam, Muon,
#: Adafactor): their groups may lack them.
_DEFAULTS_ONLY = frozenset({"differentiable"})


class Optimizer(ScaleOwner):
    r"""A :class:`torch.optim.Optimizer` that owns its dynamic loss scale.

    Subclass it exactly as you would subclass :class:`torch.optim.Optimizer`: an ordinary
    ``step()`` gets the whole protocol unchanged.

    * :meth:`unscale` divides the grads by the scale, records whether any was inf/nan and moves
      the scale (no host sync).
    * :meth:`step_after_unscale` steps, or skips the step if :meth:`unscale` found inf/nan.
    * :meth:`unscale_and_step` does both; with a closure it replays the closure with a smaller
      scale until its grads are finite (LBFGS and other closure optimizers just work).
    * :attr:`scale` is the current recommended scale, a 0-dim float32 tensor on the params'
      device, updated in place.

    Fused subclasses (:class:`scaledoptim.AdamW`, ...) skip on device and never sync. A generic
    ``step()`` cannot be told to skip on device, so for it :meth:`step_after_unscale` reads
    ``found_inf`` on the host once per step, unless the optimizer supports torch's own
    ``found_inf`` protocol (``torch.optim.AdamW(fused=True)`` does).

    Example::

        >>> opt = scaledoptim.SGD(model.parameters(), lr=0.1)
        >>> S = opt.scale
        >>> scaledoptim.scale_outputs(loss_fn(model(x), y), S).backward()
        >>> _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """

    #: The step :meth:`unscale_and_step` or :meth:`step_after_unscale` planned, for the
    #: ``self.step()`` it calls to commit (see :class:`~scaledoptim.protocol.plans.PendingStep`).
    _scaledoptim_pending: PendingStep | None = None

    # ------------------------------------------------------------------ the scale
    @property
    def scale(self) -> torch.Tensor:
        """The current recommended loss scale: a 0-dim float32 tensor on the params' device.

        It is updated in place by :meth:`unscale`; ``opt.scale.clone()`` keeps a snapshot.
        """
        return self._scaling().loss_scale.scale

    def _scaling(self) -> ScalingState:
        """This optimizer's scale and protocol state, created on first use (on the params'
        device at that time)."""
        state = self._scaledoptim_scaling
        if state is None:
            refuse_during_capture("Creating the loss scale")
            state = self._scaledoptim_scaling = ScalingState(
                LossScale(ScalingConfig(), self._params_device())
            )
        return state

    def _params_device(self) -> torch.device:
        for group in self.param_groups:
            for param in group["params"]:
                return param.device
        raise RuntimeError("The optimizer holds no parameters, so it has no device for its scale")

    def _overlapped_check(self, device: torch.device) -> Callable[[list[torch.Tensor], torch.Tensor], None] | None:
        """How ``check_during_backward`` folds a grad on ``device`` into ``found_inf`` as backward
        produces it, or ``None`` when that saves nothing: a generic step unscales, and so
        checks, every grad in place anyway."""
        return None

    # ------------------------------------------------------------------ the protocol
    # Note [compile boundary]: the protocol's Python (stage, plans, tables, host reads of a
    # closure replay) is not traceable; torch.compile runs it eagerly and compiles around it.
    @torch.compiler.disable
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
            any grad was inf/nan); ``recommended_scale`` is :attr:`scale` (``None`` if
            ``grads_scaled_by`` was ``None``).

        Raises:
            RuntimeError: if called twice without a step (or ``zero_grad``) in between, for
                sparse grads, or for grads on another device than the scale.
            ValueError: if the scale is not finite and positive.
        """
        self._check_can_unscale()
        step = self._plan_step()  # the step it prepares must be possible too
        plan = self._plan_unscale(grads_scaled_by, step)
        if plan.inv_scale is not None:
            unscale_in_place_(step.grads, plan.found_inf, plan.inv_scale)
        found_inf, scale, _ = self._record_unscale(plan)
        return found_inf, scale

    @torch.compiler.disable  # Note [compile boundary]
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
        self._plan_step().step(PendingStep(state.found_inf))
        state.found_inf = None
        return None

    @torch.compiler.disable  # Note [compile boundary]
    def unscale_and_step(
        self,
        closure: Callable[[Any], Any] | None = None,
        grads_scaled_by: torch.Tensor | float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        r"""Unscales the grads and steps, skipping the step on inf/nan.

        Without a closure: :meth:`unscale` then :meth:`step_after_unscale`, with no host sync on
        fused optimizers, whose update may fold the unscale in (our CUDA kernels do: the grads
        are then read twice and written never, so they stay *scaled*; call :meth:`unscale` and
        :meth:`step_after_unscale` when you need them unscaled, to clip them say). With
        ``closure(S) -> loss`` (which zeroes the grads and runs a backward scaled by ``S``): the
        closure is wrapped so that every call unscales and, on inf/nan, replays with the
        backed-off scale; ``self.step`` sees only the wrapped closure, so optimizers that
        evaluate it many times (LBFGS) get finite grads every time. Every closure evaluation
        counts as one step of the scale's state machine. With ``grads_scaled_by=None`` a
        torch-style ``closure()`` that takes no argument works too, exactly as in ``step``.

        Closure replay costs one host read per evaluation and a copy of params and optimizer
        state per call (to restore them if replay fails).

        Args:
            closure: optional ``closure(S) -> loss``.
            grads_scaled_by: the scale the loss was (or will be) multiplied by; ``None``: not
                scaled, nothing is unscaled or skipped.

        Returns:
            ``(loss, found_inf, S)``: ``loss`` from the closure (``None`` without one),
            ``found_inf`` as from :meth:`unscale` (always 0.0 after closure replay) and the
            recommended scale for the next iteration.

        Raises:
            ClosureReplayError: if the closure's grads stay non-finite through every replay;
                params, optimizer state and scale are then exactly as before the call.
            TypeError: a closure that takes no argument given with a scale (it could not run
                its backward scaled by ``S``), before anything changes.
        """
        if closure is not None:
            replay.check_callable(closure, "unscale_and_step", "grads_scaled_by")
            if grads_scaled_by is None:
                # A torch-style closure() (LBFGS code being migrated) steps as torch runs it.
                unscaled = closure if not replay.takes_scale(closure) else lambda: closure(None)
                loss = self.step(unscaled)  # type: ignore[arg-type]  # torch types its closure's loss as a float
                return loss, torch.zeros((), dtype=torch.float32, device=self._scaling().loss_scale.device), None
            replay.check_takes_scale(closure, "unscale_and_step")
            return replay.step_replaying(
                self, lambda s: (closure(s), *self.unscale(grads_scaled_by=s)), grads_scaled_by
            )
        self._check_can_step_without_closure("unscale_and_step")
        self._check_can_unscale()
        step = self._plan_step()
        plan = self._plan_unscale(grads_scaled_by, step)
        scaled = plan.inv_scale is not None
        left = step.unscale_grads_(plan.found_inf, plan.inv_scale, plan.checked) if plan.inv_scale is not None else None
        found_inf, scale, scale_update = self._record_unscale(plan, step.applies_scale_update)
        step.step(PendingStep(found_inf if scaled else None, left, scale_update))
        self._scaling().found_inf = None
        return None, found_inf, scale

    # ------------------------------------------------------------------ plan, then commit
    def _plan_unscale(self, grads_scaled_by: torch.Tensor | float | None, step: StepPlan) -> UnscalePlan:
        """Every check an unscale of ``step``'s grads needs (after :meth:`_check_can_unscale`);
        allocates, but changes nothing."""
        loss_scale = self._scaling().loss_scale
        device = loss_scale.scale.device
        if grads_scaled_by is None:
            return UnscalePlan(None, None, torch.zeros((), dtype=torch.float32, device=device))
        # The optimizer's own scale is valid by construction: no call to validate it.
        scale = (
            grads_scaled_by
            if grads_scaled_by is loss_scale.scale
            else as_scale_tensor(grads_scaled_by, device)
        )
        loss_scale.check_can_report(id(self))
        inv_scale = scale.double().reciprocal().float()  # as GradScaler computes it
        backward_check = self._scaledoptim_backward_check
        if backward_check is None:
            return UnscalePlan(scale, inv_scale, torch.zeros((), dtype=torch.float32, device=device))
        found_inf, checked = backward_check.take(step.params, device)
        return UnscalePlan(scale, inv_scale, found_inf, checked)

    def _check_can_unscale(self) -> None:
        """Refuses a second unscale before a step, first: planning the step would be wasted."""
        if self._scaling().found_inf is not None:
            raise RuntimeError(
                "unscale() was already called since the last step: the grads are unscaled "
                "already. Call step_after_unscale() (or zero_grad() and a new backward) first."
            )

    def _plan_step(self) -> StepPlan:
        """Validates everything a step will need (param groups, grads, ...) and returns it,
        ready to run; changes nothing.

        The hook a subclass answers. This generic plan calls ``self.step()`` as it is: it reads
        ``found_inf`` on the host to skip, or hands it to an optimizer that implements torch's
        own on-device ``found_inf`` protocol (``_step_supports_amp_scaling``).
        """
        self._check_param_groups()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        check_param_grads(params, self._scaling().loss_scale.device)
        return GenericStepPlan(self, params)

    def _check_param_groups(self) -> None:
        """Rejects a param group that lost an option its optimizer's defaults have (torch would
        raise a bare ``KeyError`` mid-step)."""
        for index, group in enumerate(self.param_groups):
            if not self.defaults.keys() <= group.keys():
                missing = sorted(key for key in self.defaults.keys() - group.keys() - _DEFAULTS_ONLY)
                if not missing:
                    continue
                raise ValueError(
                    f"param_groups[{index}] has no {missing}: every param group must hold all of "
                    f"{type(self).__name__}'s options. Add groups with opt.add_param_group(...) "
                    "(it fills in the defaults), or restore the key, e.g. "
                    f"opt.param_groups[{index}][{missing[0]!r}] = opt.defaults[{missing[0]!r}]"
                )

    def _record_unscale(
        self, plan: UnscalePlan, defer_scale_update: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, ScaleUpdate | None]:
        """Agrees on ``found_inf`` across the process group, records it for the step and moves
        the scale, or returns the move for the step's epilogue to apply (no host sync). Every
        unscale path ends here."""
        state = self._scaling()
        if plan.scale is None:
            state.found_inf = plan.found_inf
            return plan.found_inf, None, None
        if state.process_group is not None:
            try:
                agree_on_found_inf(plan.found_inf, state.process_group)  # before anything uses it
            except BaseException:
                # The grads may already be unscaled in place, so a second unscale() must be
                # refused; and this rank cannot know whether another overflowed: skip the step.
                plan.found_inf.fill_(1.0)
                state.found_inf = plan.found_inf
                raise
        state.found_inf = plan.found_inf
        scale_update = state.loss_scale.report(
            id(self), plan.scale, plan.found_inf,
            force_backoff=state.replaying, defer=defer_scale_update,
        )  # fmt: skip
        return plan.found_inf, state.loss_scale.scale, scale_update

    def _check_can_step_without_closure(self, method: str) -> None:
        if isinstance(self, torch.optim.LBFGS):
            raise RuntimeError(
                f"LBFGS evaluates a closure on every step, so {method}() needs one: "
                "opt.unscale_and_step(closure, grads_scaled_by=S) with closure(S) -> loss"
            )

    # ------------------------------------------------------------------ torch.optim overrides
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also forgets an unconsumed :meth:`unscale`."""
        super().zero_grad(set_to_none)
        state = self._scaledoptim_scaling
        if state is not None:
            state.found_inf = None
