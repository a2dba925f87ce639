"""The loss-scaling protocol, inherited by every scaledoptim optimizer.

The base class owns the step sequence, the same for every optimizer:

1. plan: every check that can fail (the stage, the scale, param groups, grads, and whatever the
   step will need, which :meth:`Optimizer._plan_step` validates), before anything changes;
2. unscale the grads in place, or only check them when the update folds the unscale in;
3. agree on ``found_inf`` across the process group, record it and move the scale;
4. step, through ``self.step()`` so that hooks, schedulers and the profiler see a step.

A subclass answers one hook, :meth:`Optimizer._plan_step`; the fused optimizers answer it with
an update that skips on device (Note [found_inf contract] in cuda/common.cuh).

Note [step requests]
~~~~~~~~~~~~~~~~~~~~
Every protocol step goes through ``self.step()``, and ``step()`` itself honours the protocol:

* A protocol method hands the step it wants to ``step()`` as a :class:`StepRequest`. An optimizer
  whose update we own (:attr:`Optimizer._plans_in_step`: the fused ones) receives it in ``step()``
  and plans there, *after* the step pre-hooks ran, so what a hook does to the grads (assigned,
  zeroed in place) is what the plan validates, checks and uses. Any other optimizer is planned,
  unscaled and read on the host first, and its ``step()`` runs only when not skipped
  (torch.amp.GradScaler's order; the hooks see unscaled grads).
* A plain ``step()`` call asks :meth:`Optimizer._implicit_request` what the protocol owes it:
  after :meth:`~Optimizer.unscale`, the pending ``found_inf`` (``step_after_unscale``); after a
  backward scaled by ``opt.scale`` (Note [scale handles] in scale/loss_scale.py), an unscale
  (``unscale_and_step``); with ``grad_scale``/``found_inf`` set by ``torch.amp.GradScaler``,
  those. So the GradScaler habits ``scale_outputs(loss, S).backward(); opt.step()`` and
  ``opt.unscale(...); opt.step()`` never step on scaled grads or past an overflow.
  Fused optimizers do this in their ``step()``; every other subclass's ``step`` is wrapped by
  :meth:`Optimizer.__init_subclass__` (and :func:`~scaledoptim.with_scaling`) in a guard that
  does it around the step it wraps. The protocol's own calls of ``step()`` set
  ``_scaledoptim_stepping``, which the guard lets through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import compile_boundary
from ..scale import (
    LossScale,
    ScalingConfig,
)
from ..torch_ops import refuse_during_capture
from . import replay
from .backward_check import GradCheck
from .clipping import (
    check_max_grad_norm,
    clip_in_place_,
    clipping_each_call,
    norm_and_coefficient,
    sum_of_squares,
    sums_over_process_group,
)
from .ownership import ScalingState
from .plans import (
    GenericStepPlan,
    PendingStep,
    StepOutcome,
    StepPlan,
    StepRequest,
)
from .replay import ClosureReplayError
from .split_form import SplitForm
from .validation import check_param_grads

__all__ = ["ClosureReplayError", "Optimizer", "StepRequest"]


class Optimizer(SplitForm):
    r"""A :class:`torch.optim.Optimizer` that owns its dynamic loss scale.

    Subclass it exactly as you would subclass :class:`torch.optim.Optimizer`: an ordinary
    ``step()`` gets the whole protocol unchanged.

    * :meth:`unscale` divides the grads by the scale, records whether any was inf/nan and moves
      the scale (no host sync).
    * :meth:`step_after_unscale` steps, or skips the step if :meth:`unscale` found inf/nan.
    * :meth:`unscale_and_step` does both; with a closure it replays the closure with a smaller
      scale until its grads are finite (LBFGS and other closure optimizers just work).
    * :attr:`scale` is the current recommended scale, a 0-dim float32 tensor on the params'
      device, updated in place: one tensor for the optimizer's lifetime (checkpoint loads and
      :meth:`configure_scaling` copy into it).
    * A plain ``step()`` never applies scaled grads: after a backward scaled by :attr:`scale`
      it unscales and skips on overflow as :meth:`unscale_and_step` does; after
      :meth:`unscale` it skips on ``found_inf`` as :meth:`step_after_unscale` does.

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

    #: The request the ``self.step()`` a protocol method calls must carry out, and what it used.
    _scaledoptim_request: StepRequest | None = None
    _scaledoptim_outcome: StepOutcome | None = None
    #: The pre-clip norm of the last step that clipped (:attr:`grad_norm`).
    _scaledoptim_grad_norm: torch.Tensor | None = None

    # ------------------------------------------------------------------ the scale
    @property
    def scale(self) -> torch.Tensor:
        """The current recommended loss scale: a 0-dim float32 tensor on the params' device.

        It is updated in place by :meth:`unscale`; ``opt.scale.clone()`` keeps a snapshot. It is
        one tensor for the optimizer's lifetime: :meth:`load_state_dict`,
        :meth:`configure_scaling` and :meth:`load_gradscaler_state_dict` copy into it, so
        ``S = opt.scale`` taken once stays the scale in use. After
        :func:`~scaledoptim.share_scale` it is the first optimizer's tensor, and after a
        :class:`scaledoptim.GradScaler` stepped the optimizer, the scaler's; an old tensor is
        then refused by the protocol with the one to pass instead.
        """
        return self._scaling().loss_scale.scale

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total 2-norm of the unscaled grads, before clipping, of the last
        :meth:`unscale_and_step` given ``max_grad_norm`` (``None`` before the first).

        A 0-dim float32 tensor on the params' device, computed on device during the step (read
        it when you choose: ``opt.grad_norm.item()`` is a host sync). It is the norm
        :func:`torch.nn.utils.clip_grad_norm_` returns, over all of the optimizer's grads (across
        the ranks of ``process_group``, and over whole DTensors); inf or nan when the step
        overflowed (and so was skipped). Each step stores a new tensor, so a kept value stays.
        """
        return self._scaledoptim_grad_norm

    def _scaling(self) -> ScalingState:
        """This optimizer's scale and protocol state, created on first use (on the params'
        device at that time)."""
        state = self._scaledoptim_scaling
        if state is None:
            state = self._create_scaling()
        return state

    # Created eagerly even when first touched inside torch.compile: a scale created while
    # tracing could be a different tensor from the one the protocol moves, and then the scale
    # the next compiled call reads never backs off.
    @compile_boundary.disable
    def _create_scaling(self) -> ScalingState:
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

    def _overlapped_check(self, device: torch.device) -> GradCheck | None:
        """How ``check_during_backward`` folds a grad on ``device`` into ``found_inf`` as backward
        produces it, or ``None`` when that saves nothing: a generic step unscales, and so
        checks, every grad in place anyway."""
        return None

    # ------------------------------------------------------------------ the protocol
    @compile_boundary.disable  # See Note [compile boundary]
    def unscale_and_step(
        self,
        closure: Callable[[Any], Any] | None = None,
        grads_scaled_by: torch.Tensor | float | None = None,
        max_grad_norm: float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        r"""Unscales the grads, optionally clips their global norm, and steps, skipping the step
        on inf/nan.

        Without a closure: :meth:`unscale` then :meth:`step_after_unscale`, with no host sync on
        fused optimizers, whose update may fold the unscale in (our CUDA kernels do: the grads
        are then read twice and written never, so they stay *scaled*; call :meth:`unscale` and
        :meth:`step_after_unscale` when you need them unscaled, to inspect them say; to clip
        them, pass ``max_grad_norm``). With
        ``closure(S) -> loss`` (which zeroes the grads and runs a backward scaled by ``S``): the
        closure is wrapped so that every call unscales and, on inf/nan, replays with the
        backed-off scale; ``self.step`` sees only the wrapped closure, so optimizers that
        evaluate it many times (LBFGS) get finite grads every time. Every closure evaluation
        counts as one step of the scale's state machine. With ``grads_scaled_by=None`` a
        torch-style ``closure()`` that takes no argument works too, exactly as in ``step``.

        Closure replay costs one host read per evaluation and a copy of params and optimizer
        state per call (to restore them if replay fails).

        With ``max_grad_norm=c`` the step clips as :func:`torch.nn.utils.clip_grad_norm_` does
        after :meth:`torch.amp.GradScaler.unscale_`: ``total`` is the 2-norm of the unscaled
        grads of all the optimizer's params, and the update reads each unscaled grad times
        ``min(c / (total + 1e-6), 1)``; ``total`` is kept in :attr:`grad_norm`. No host sync:
        on our kernels the norm comes from the inf/nan check's read of the grads (in float32) and
        the clip factor is applied with the unscale in the update (the grads stay scaled and are
        read no more often than without clipping); on a CPU torch's fused Adam(W), SGD and
        Adagrad apply it with the unscale where they read the grads, and the other torch forms
        and generic optimizers multiply the grads they unscaled in place, as
        ``clip_grad_norm_`` does. It works for fp16 grads, which :meth:`unscale` refuses. A step
        that overflows is skipped as always. Under ``process_group`` plain params need
        :meth:`configure_scaling`'s ``grads_across_ranks``: ``"sharded"`` adds the ranks' sums
        of squares (each rank's optimizer holds its own part of the model), ``"replicated"``
        (DDP) takes each rank's own norm of the same grads. DTensor params (FSDP2) count their
        whole sharded tensors, over their mesh, as ``clip_grad_norm_`` does (not added again
        over ``process_group``; params mixing DTensors and plain tensors under
        ``process_group`` are refused). With a closure every
        evaluation is clipped after it is unscaled (its grads are unscaled in place). LAMB's own
        ``max_grad_norm`` option then clips what this clip left. To clip by another rule, call
        :meth:`unscale`, clip the grads yourself and :meth:`step_after_unscale`.

        Args:
            closure: optional ``closure(S) -> loss``.
            grads_scaled_by: the scale the loss was (or will be) multiplied by; ``None``: not
                scaled, nothing is unscaled or skipped.
            max_grad_norm: clip the global 2-norm of the unscaled grads to this (a finite
                Python float > 0); ``None`` (default): no clipping, the step is unchanged.

        Returns:
            ``(loss, found_inf, S)``: ``loss`` from the closure (``None`` without one),
            ``found_inf`` as from :meth:`unscale` (always 0.0 after closure replay) and the
            recommended scale for the next iteration.

        On fused optimizers the step pre-hooks run first, on the grads as backward left them
        (scaled), and the step validates, checks and uses what they leave; on other optimizers
        they run in ``self.step()``, after the unscale, on a step that is not skipped (as under
        :class:`torch.amp.GradScaler`).

        Raises:
            ClosureReplayError: if the closure's grads stay non-finite through every replay;
                params, optimizer state and scale are then exactly as before the call.
            TypeError: a closure that takes no argument given with a scale (it could not run
                its backward scaled by ``S``), or a ``max_grad_norm`` that is not a Python number
                (a tensor, a bool), before anything changes.
            ValueError: a ``max_grad_norm`` that is not finite and > 0, or with
                ``process_group`` params that mix DTensors and plain tensors, or plain params
                without ``grads_across_ranks`` (see :meth:`configure_scaling`), before anything
                changes.
            RuntimeError: ``grads_scaled_by=None`` after a backward scaled by :attr:`scale`
                (the grads are scaled), a scale tensor no longer in use (see :meth:`unscale`),
                or an optimizer a :class:`scaledoptim.GradScaler` steps.
        """
        self._check_own_protocol("unscale_and_step")
        check_max_grad_norm(max_grad_norm)
        if max_grad_norm is not None:
            self._clip_sums_over_process_group()  # raises for a mix it cannot add up
        if closure is not None:
            replay.check_callable(closure, "unscale_and_step", "grads_scaled_by")
            if grads_scaled_by is None:
                # A torch-style closure() (LBFGS code being migrated) steps as torch runs it.
                unscaled = closure if not replay.takes_scale(closure) else lambda: closure(None)
                if max_grad_norm is not None:
                    unscaled = clipping_each_call(
                        unscaled,  # type: ignore[arg-type]  # torch-style: takes no argument
                        self._clip_in_place,
                        max_grad_norm,
                    )
                loss = self.step(unscaled)  # type: ignore[arg-type]  # torch types its closure's loss as a float
                return (
                    loss,
                    torch.zeros((), dtype=torch.float32, device=self._scaling().loss_scale.device),
                    None,
                )
            replay.check_takes_scale(closure, "unscale_and_step")

            def evaluate(scale: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
                loss = closure(scale)
                found_inf, recommended = self.unscale(grads_scaled_by=scale)
                if max_grad_norm is not None:  # the grads are unscaled in place: clip them so
                    self._clip_in_place(max_grad_norm)
                return loss, found_inf, recommended

            return replay.step_replaying(self, evaluate, grads_scaled_by)
        self._check_can_step_without_closure("unscale_and_step")
        self._check_can_unscale()
        self._check_told_unscaled(grads_scaled_by)
        _, outcome = self._run_step(StepRequest(
            unscale=True, scaled_by=grads_scaled_by, max_grad_norm=max_grad_norm
        ))
        if outcome is None:
            raise RuntimeError(
                f"{type(self).__name__}.step() did not run the step unscale_and_step() asked "
                "for: a subclass of FusedOptimizer that overrides step() must call super().step()"
            )
        return None, outcome.found_inf, outcome.scale

    # ------------------------------------------------------------------ plan, then commit
    def _run_step(
        self, request: StepRequest, *args: Any, **kwargs: Any
    ) -> tuple[Any, StepOutcome | None]:
        """Runs ``self.step(*args, **kwargs)`` carrying ``request`` out (Note [step requests]);
        returns what the step returned (``None`` for a step skipped on the host) and its
        outcome, ``None`` when a ``step()`` override never carried the request out.

        Package-internal: :class:`scaledoptim.GradScaler` steps an optimizer through it.
        """
        if not self._plans_in_step:
            run = functools.partial(self.step, *args, **kwargs) if args or kwargs else None
            return self._execute(request, run=run)
        # step() takes no request and returns the loss: the request and its outcome pass
        # through these two slots, each read once.
        self._scaledoptim_request, self._scaledoptim_outcome = request, None
        try:
            result = self.step(*args, **kwargs)
            return result, self._scaledoptim_outcome
        finally:
            self._scaledoptim_request = self._scaledoptim_outcome = None

    def _execute(
        self, request: StepRequest, run: Callable[[], Any] | None = None
    ) -> tuple[Any, StepOutcome]:
        """Plans the step, unscales, records ``found_inf`` and commits: ``request`` carried out.
        Returns what the step returned and the :class:`StepOutcome`.

        Called by a fused ``step()`` (after its pre-hooks), by :meth:`_run_step` for other
        optimizers, and by the guard of a plain ``step()``, which passes the step function it
        wraps as ``run`` (that step call is under way already). Every check runs before
        anything changes.
        """
        step = self._plan_step()
        state = self._scaling()
        if isinstance(step, GenericStepPlan) and run is not None:
            step.run = run
        if request.unscale:
            plan = self._plan_unscale(
                request.scaled_by, step, own=request.moves_scale, found_inf=request.found_inf
            )
            if request.adopt is not None:
                self._adopt_scale(*request.adopt)  # the GradScaler's scale, once all is checked
            scaled = plan.inv_scale is not None
            clip, norm_sq = request.max_grad_norm, None
            if clip is not None:
                # See Note [clipping in the step] in clipping.py: the check sums the squares of
                # every grad (those checked during backward too: a plan given norm_sq ignores
                # checked). Unscaled grads are checked into a flag of their own: nothing skips
                # their step.
                norm_sq = torch.zeros((), dtype=torch.float32, device=plan.found_inf.device)
                checking = plan.found_inf if scaled else torch.zeros_like(plan.found_inf)
                inv = plan.inv_scale if plan.inv_scale is not None else torch.ones_like(checking)
                left = step.unscale_grads_(checking, inv, plan.checked, norm_sq)
            elif plan.inv_scale is not None:
                left = step.unscale_grads_(plan.found_inf, plan.inv_scale, plan.checked)
            else:
                left = None
            if request.moves_scale:
                found_inf, scale, update = self._record_unscale(plan, step.applies_scale_update)
            else:  # a GradScaler's scale: it moves in scaler.update()
                found_inf, scale, update = self._agree(plan.found_inf), None, None
            if clip is not None and norm_sq is not None:
                step.clip_grads_(self._clip_coefficient(norm_sq, clip))
            pending = PendingStep(found_inf if scaled else None, left, update)
            outcome = StepOutcome(found_inf, scale)
        else:
            # Every request that does not unscale carries the found_inf to skip on.
            assert request.found_inf is not None
            pending = PendingStep(request.found_inf)
            outcome = StepOutcome(request.found_inf, None)
        self._scaledoptim_stepping = True  # a plan that calls self.step() is let through
        try:
            result = step.commit(pending)
        finally:
            self._scaledoptim_stepping = False
        state.found_inf = None
        return result, outcome

    def _clip_coefficient(self, norm_sq: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
        """The clip factor from this rank's sum of squares; keeps the norm in :attr:`grad_norm`
        (Note [clipping in the step] in clipping.py). On device, no host read."""
        summing = self._clip_sums_over_process_group()  # not for DTensors: over their mesh
        process_group = self._scaling().process_group if summing else None
        norm, coef = norm_and_coefficient(norm_sq, max_grad_norm, process_group)
        self._scaledoptim_grad_norm = norm
        return coef

    def _clip_sums_over_process_group(self) -> bool:
        """Whether the clip's sums of squares are added over ``process_group`` (not for DTensor
        params: Note [clipping in the step] in clipping.py)."""
        params = [p for g in self.param_groups for p in g["params"]]
        state = self._scaling()
        return sums_over_process_group(params, state.process_group, state.grads_across_ranks)

    def _clip_in_place(self, max_grad_norm: float) -> None:
        """Clips the grads, unscaled in place, as ``clip_grad_norm_`` does."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm_sq = sum_of_squares(grads, self._scaling().loss_scale.device)
        clip_in_place_(grads, self._clip_coefficient(norm_sq, max_grad_norm))

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

    # ------------------------------------------------------------------ torch.optim overrides
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also forgets an unconsumed :meth:`unscale`
        and what ``check_during_backward`` folded from the grads it drops."""
        super().zero_grad(set_to_none)
        state = self._scaledoptim_scaling
        if state is not None:
            state.found_inf = None
        if self._scaledoptim_backward_check is not None:
            self._scaledoptim_backward_check.reset()
