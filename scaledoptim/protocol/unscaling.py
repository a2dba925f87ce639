"""The unscale half of :class:`scaledoptim.Optimizer`: planning an unscale, recording its
``found_inf`` and moving the scale, and the checks the protocol's entry points make first
(Note [step requests] in optimizer.py). Also what :class:`scaledoptim.GradScaler` calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..scale import LossScale, ScaleUpdate, agree_on_found_inf, as_scale_tensor, handle_state
from ..torch_ops import unscale_in_place_
from .outputs import check_grads_scaled_by
from .plain_step import PlainStepGuard
from .plans import GenericStepPlan, StepPlan, UnscalePlan
from .torch_scaler_interop import asked_by_torch_scaler
from .validation import check_no_fp16_grads, check_no_fp16_grads_in_place

#: Options torch.optim's ``__setstate__`` (run by ``load_state_dict``) adds to the defaults of
#: every optimizer, but not to the groups of those that never had them (LBFGS, SparseAdam, Muon,
#: Adafactor): their groups may lack them.
_DEFAULTS_ONLY = frozenset({"differentiable"})


class UnscalePlanner(PlainStepGuard):
    """The unscale half of :class:`scaledoptim.Optimizer`. Not used on its own."""

    if TYPE_CHECKING:  # defined by scaledoptim.Optimizer, next to the per-step protocol

        def _plan_step(self) -> StepPlan: ...

    def _plan_unscale(
        self,
        grads_scaled_by: torch.Tensor | float | None,
        step: StepPlan,
        *,
        own: bool = True,
        found_inf: torch.Tensor | None = None,
    ) -> UnscalePlan:
        """Every check an unscale of ``step``'s grads needs (after :meth:`_check_can_unscale`);
        allocates, but changes nothing.

        ``own``: by this optimizer's scale protocol (the scale is validated and will move);
        otherwise by a GradScaler's scale, trusted as it is and moved by the scaler, with
        ``found_inf`` (if given) the flag the check adds to.
        """
        loss_scale = self._scaling().loss_scale
        device = loss_scale.scale.device
        if grads_scaled_by is None:
            return UnscalePlan(None, None, torch.zeros((), dtype=torch.float32, device=device))
        if isinstance(step, GenericStepPlan):  # it unscales in place, in the grads' dtype
            check_no_fp16_grads_in_place(step.grads, type(self).__name__)
        if not own:
            assert isinstance(grads_scaled_by, torch.Tensor)
            scale = grads_scaled_by.to(device, torch.float32, non_blocking=True)
        elif grads_scaled_by is loss_scale.scale:  # valid by construction: nothing to validate
            scale = grads_scaled_by
        else:
            handle = (
                handle_state(grads_scaled_by) if isinstance(grads_scaled_by, torch.Tensor) else None
            )
            if handle is not None and handle["retired"] is not None:
                raise RuntimeError(
                    f"grads_scaled_by is a scale no longer in use. {handle['retired']}"
                )
            scale = as_scale_tensor(grads_scaled_by, device)
        if own:
            loss_scale.check_can_report(id(self))
            check_grads_scaled_by(
                grads_scaled_by, loss_scale.scale, loss_scale.scaled_for(id(self))
            )
        inv_scale = scale.double().reciprocal().float()  # as GradScaler computes it
        backward_check = self._scaledoptim_backward_check
        if backward_check is None:
            flag = (
                torch.zeros((), dtype=torch.float32, device=device)
                if found_inf is None
                else found_inf.clone()
            )
            return UnscalePlan(scale, inv_scale, flag)
        flag, checked = backward_check.take(step.params, device, scale)
        if found_inf is not None:
            flag = torch.maximum(flag, found_inf)
        return UnscalePlan(scale, inv_scale, flag, checked)

    def _check_can_unscale(self) -> None:
        """Refuses a second unscale before a step, first: planning the step would be wasted."""
        if self._scaling().found_inf is not None:
            raise RuntimeError(
                "unscale() was already called since the last step: the grads are unscaled "
                "already. Call step_after_unscale() (or zero_grad() and a new backward) first."
            )

    def _check_param_groups(self) -> None:
        """Rejects a param group that lost an option its optimizer's defaults have (torch would
        raise a bare ``KeyError`` mid-step)."""
        for index, group in enumerate(self.param_groups):
            if not self.defaults.keys() <= group.keys():
                missing = sorted(
                    key for key in self.defaults.keys() - group.keys() - _DEFAULTS_ONLY
                )
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
        unscale of the optimizer's own protocol ends here."""
        state = self._scaling()
        if plan.scale is None:
            state.found_inf = plan.found_inf
            return plan.found_inf, None, None
        try:
            self._agree(plan.found_inf)
        except BaseException:
            # The grads may already be unscaled in place, so a second unscale() must be
            # refused; and this rank cannot know whether another overflowed: skip the step.
            state.found_inf = plan.found_inf
            raise
        state.found_inf = plan.found_inf
        scale_update = state.loss_scale.report(
            id(self), plan.scale, plan.found_inf,
            force_backoff=state.replaying, defer=defer_scale_update,
        )
        return plan.found_inf, state.loss_scale.scale, scale_update

    def _agree(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Agrees on ``found_inf`` across the process group (MAX, on device), before anything
        uses it; on a failure it is set (this rank cannot know whether another overflowed)."""
        process_group = self._scaling().process_group
        if process_group is not None:
            try:
                agree_on_found_inf(found_inf, process_group)
            except BaseException:
                found_inf.fill_(1.0)
                raise
        return found_inf

    def _check_own_protocol(self, method: str) -> None:
        """Refuses the optimizer's own unscale methods on an optimizer a GradScaler steps: the
        scaler moves the scale in ``update()``, and this would move it too."""
        state = self._scaledoptim_scaling
        if state is not None and state.driver is not None:
            raise RuntimeError(
                f"{method}() on an optimizer stepped by a {state.driver}, which owns its scale: "
                "step it with scaler.step(opt) (scaler.unscale_(opt) first to clip) and end the "
                "iteration with scaler.update()"
            )

    def _check_told_unscaled(self, grads_scaled_by: torch.Tensor | float | None) -> None:
        """Refuses ``grads_scaled_by=None`` (nothing to unscale or skip) after a backward scaled
        by :attr:`scale`: the step would apply scaled grads."""
        state = self._scaledoptim_scaling
        if grads_scaled_by is None and state is not None and state.loss_scale.scaled_for(id(self)):
            raise RuntimeError(
                "grads_scaled_by=None says the grads are not scaled, but they come from a "
                "backward scaled by opt.scale (scaledoptim.scale_outputs(loss, opt.scale)): pass "
                "grads_scaled_by=opt.scale, or scale the loss by None for unscaled training"
            )

    def _adopt_scale(self, loss_scale: LossScale, driver: str) -> None:
        """Makes a GradScaler's ``loss_scale`` this optimizer's scale: ``opt.scale`` is the
        scaler's from now on, and checkpoints carry it. The optimizer's own scale tensor is
        retired (Note [scale handles])."""
        state = self._scaling()
        if state.loss_scale is not loss_scale:
            if state.driver is None:  # (another scaler's scale is that scaler's business)
                state.loss_scale.retire(
                    f"This was {type(self).__name__}'s own scale, before a {driver} took it "
                    "over: the scaler's scale is the one in use (opt.scale returns it now)"
                )
            state.loss_scale = loss_scale
        state.driver = driver

    def _unscale_for_scaler(
        self, scaled_by: torch.Tensor, loss_scale: LossScale, driver: str
    ) -> torch.Tensor | None:
        """:meth:`scaledoptim.GradScaler.unscale_` (package-internal): unscales the grads by the
        scaler's ``scaled_by`` without moving it, after every check, and takes the scaler's
        ``loss_scale`` as this optimizer's. Returns the agreed ``found_inf``, or ``None`` when
        no param has a grad (nothing is checked or changed)."""
        step = self._plan_step()
        if not step.grads:
            return None
        if not isinstance(step, GenericStepPlan):  # a generic step's: in _plan_unscale
            check_no_fp16_grads(step.grads, "GradScaler.unscale_()")
        plan = self._plan_unscale(scaled_by, step, own=False)
        assert plan.inv_scale is not None  # a scale was given
        self._adopt_scale(loss_scale, driver)
        unscale_in_place_(step.grads, plan.found_inf, plan.inv_scale)
        return self._agree(plan.found_inf)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's flag for "my step() reads ``grad_scale`` and ``found_inf``" (Note [torch
        GradScaler])."""
        return asked_by_torch_scaler(self)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        vars(self)["_step_supports_amp_scaling"] = value  # torch's fused __init__ sets it

    def _check_can_step_without_closure(self, method: str) -> None:
        if isinstance(self, torch.optim.LBFGS):
            raise RuntimeError(
                f"LBFGS evaluates a closure on every step, so {method}() needs one: "
                "opt.unscale_and_step(closure, grads_scaled_by=S) with closure(S) -> loss"
            )
