"""``scaledoptim.Optimizer``: the loss-scaling protocol, inherited by every scaledoptim optimizer.

One class, its documented methods and the state they own; what they run lives by job: the step's
stages in ``steps.py``, closure replay in ``replay.py``, the plain-``step()`` guard in
``guard.py``, the scale's configuration, checkpoints and copies in ``scaling.py``. A subclass
answers one hook, :meth:`Optimizer._plan_step` (the fused optimizers: ``fused/plan.py``).

Note [compile boundary]
~~~~~~~~~~~~~~~~~~~~~~~
The protocol's Python (stage, plans, tables, host reads of a closure replay) is not traceable;
torch.compile runs it eagerly and compiles around it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, ClassVar, TypeVar

import torch

from .. import compile_boundary
from ..scale import gradscaler_state_from_loss_scale
from . import guard, replay, scaling, split_form, steps
from .backward_check import BackwardCheck, GradCheck
from .plans import GenericStepPlan, check_param_groups
from .scale_carrying import GROUP_SCALE_KEY
from .scaling import ScalingState
from .values import GradPass, Request, StepPlan

__all__ = ["Optimizer"]

_Self = TypeVar("_Self", bound="Optimizer")


class Optimizer(torch.optim.Optimizer):
    r"""A :class:`torch.optim.Optimizer` that owns its dynamic loss scale.

    Subclass it exactly as you would subclass :class:`torch.optim.Optimizer`: an ordinary
    ``step()`` gets the whole protocol unchanged.

    * :meth:`unscale` divides the grads by the scale, records whether any was inf/nan and moves
      the scale (no host sync).
    * :meth:`step_after_unscale` steps, or skips the step if :meth:`unscale` found inf/nan.
    * :meth:`unscale_and_step` does both; with a closure it replays the closure with a smaller
      scale until its grads are finite (LBFGS and other closure optimizers just work).
    * :attr:`scale` is the current recommended scale, a 0-dim float32 tensor on the params'
      device, updated in place: one tensor for the optimizer's lifetime.
    * A plain ``step()`` never applies scaled grads: after a backward scaled by :attr:`scale`
      it unscales and skips on overflow as :meth:`unscale_and_step` does; after
      :meth:`unscale` it skips on ``found_inf`` as :meth:`step_after_unscale` does.

    Fused subclasses (:class:`scaledoptim.AdamW`, ...) skip on device and never sync; a generic
    ``step()`` is skipped after one host read of ``found_inf`` per step, unless it takes torch's
    own ``found_inf`` (``torch.optim.AdamW(fused=True)`` does).

    Example::

        >>> opt = scaledoptim.SGD(model.parameters(), lr=0.1)
        >>> S = opt.scale
        >>> scaledoptim.scale_outputs(loss_fn(model(x), y), S).backward()
        >>> _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """

    # Per-instance, set lazily (with_scaling's classes and patched instances have no __init__ of
    # ours): the scale and protocol state, the backward check, grad_norm, the request a protocol
    # method hands step() and its pass, and whether the protocol runs step() (Note [step
    # requests] in guard.py).
    _scaledoptim_scaling: ScalingState | None = None
    _scaledoptim_backward_check: BackwardCheck | None = None
    _scaledoptim_warned_torch_scaler: bool = False
    _scaledoptim_grad_norm: torch.Tensor | None = None
    _scaledoptim_request: Request | None = None
    _scaledoptim_outcome: GradPass | None = None
    _scaledoptim_stepping: bool = False
    #: Whether ``step()`` is the protocol's (``steps.planned_step``: the fused optimizers).
    _plans_in_step: ClassVar[bool] = False
    #: The last step's plan, kept for the next (Note [step cache] in fused/plan.py); not pickled.
    _step_cache: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wraps a subclass's own ``step`` in the protocol's guard (``guard.py``)."""
        super().__init_subclass__(**kwargs)
        guard.wrap_step(cls)

    # ------------------------------------------------------------------ the scale and its state
    @property
    def scale(self) -> torch.Tensor:
        """The current recommended loss scale: a 0-dim float32 tensor on the params' device.

        Updated in place (``opt.scale.clone()`` keeps a snapshot), and one tensor for the
        optimizer's lifetime: loads and :meth:`configure_scaling` copy into it, so
        ``S = opt.scale`` taken once stays the scale in use. After
        :func:`~scaledoptim.share_scale` or a :class:`scaledoptim.GradScaler`'s first step it is
        their tensor; an old one is refused with the one to pass instead.
        """
        return self._scaling().loss_scale.scale

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total 2-norm of the unscaled grads, before clipping, of the last
        :meth:`unscale_and_step` given ``max_grad_norm`` (``None`` before the first).

        A 0-dim float32 tensor on the params' device, computed on device during the step
        (``opt.grad_norm.item()`` is a host sync): the norm
        :func:`torch.nn.utils.clip_grad_norm_` returns, over all of the optimizer's grads; inf or
        nan when the step overflowed (and was skipped). Each step stores a new tensor.
        """
        return self._scaledoptim_grad_norm

    @property
    def scaling_state(self) -> ScalingState:
        """This optimizer's loss scale and its place in the protocol (read-only).

        The :class:`~scaledoptim.scale.LossScale` in use, the step an :meth:`unscale` left
        pending, the process group; created on first use, on the params' device.
        """
        return self._scaling()

    def _scaling(self) -> ScalingState:
        """The scale and protocol state, created on first use (on the params' device then)."""
        state = self._scaledoptim_scaling
        return state if state is not None else scaling.create(self)

    def _params_device(self) -> torch.device:
        for group in self.param_groups:
            for param in group["params"]:
                return param.device
        raise RuntimeError("The optimizer holds no parameters, so it has no device for its scale")

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
        stay scaled). With ``closure(S) -> loss`` (which zeroes the grads and runs a backward
        scaled by ``S``): every evaluation is checked and replayed with the backed-off scale on
        inf/nan, so ``self.step`` only sees finite grads, however often it evaluates the closure
        (LBFGS); one host read per evaluation (the protocol page's *Closures*). With
        ``grads_scaled_by=None`` a torch-style ``closure()`` works too.

        With ``max_grad_norm=c`` the update reads each unscaled grad times
        ``min(c / (total + 1e-6), 1)``, ``total`` being the 2-norm of the unscaled grads of all
        the optimizer's params, as after :meth:`torch.amp.GradScaler.unscale_` and
        :func:`torch.nn.utils.clip_grad_norm_`; ``total`` is kept in :attr:`grad_norm`. No host
        sync and no extra pass over the grads, fp16 grads included (the protocol page's
        *Clipping in the step*).

        A fused optimizer's step pre-hooks see the grads as backward left them, other optimizers'
        see them unscaled. If the update fails nothing is committed (scale, trackers, counters,
        :attr:`grad_norm`): the same call takes the step again, or :meth:`step_after_unscale`
        does where the grads were unscaled in place already.

        Args:
            closure: optional ``closure(S) -> loss``.
            grads_scaled_by: the scale the loss was (or will be) multiplied by; ``None``: not
                scaled, nothing is unscaled or skipped.
            max_grad_norm: clip the global 2-norm of the unscaled grads to this (a Python number
                > 0, converted to a float); ``None`` (default) or ``0``: no clipping.

        Returns:
            ``(loss, found_inf, S)``: ``loss`` from the closure (``None`` without one),
            ``found_inf`` as from :meth:`unscale` (always 0.0 after closure replay) and the
            recommended scale for the next iteration.

        Raises:
            ClosureReplayError: if the closure's grads stay non-finite through every replay;
                params, optimizer state and scale are then exactly as before the call.
            TypeError: a closure that takes no argument given with a scale, or a
                ``max_grad_norm`` that is not a Python number, before anything changes.
            ValueError: a ``max_grad_norm`` that is negative or not finite, or clipping under
                ``process_group`` that cannot add the norm up (see :meth:`configure_scaling`).
            RuntimeError: ``grads_scaled_by=None`` after a backward scaled by :attr:`scale`, a
                scale tensor no longer in use, a step still pending after :meth:`unscale`, or an
                optimizer a :class:`scaledoptim.GradScaler` steps.
        """
        state = steps.own_state(self, "unscale_and_step")
        if closure is not None:
            return replay.unscale_and_step(self, closure, grads_scaled_by, max_grad_norm)
        steps.check_closure_free(self, "unscale_and_step")
        steps.check_can_unscale(state, grads_scaled_by, id(self))
        request = steps.validate_request(self, state, grads_scaled_by, max_grad_norm)
        found_inf = steps.run_step(self, request)[1].found_inf
        if found_inf is None:  # nothing was checked: the grads are not scaled
            found_inf = torch.zeros((), dtype=torch.float32, device=state.loss_scale.device)
        return None, found_inf, None if request.scaled_by is None else state.loss_scale.scale

    @compile_boundary.disable  # See Note [compile boundary]
    @torch.no_grad()
    def unscale(
        self, grads_scaled_by: torch.Tensor | float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""Divides every grad by ``grads_scaled_by`` in place and checks them for inf/nan.

        Records ``found_inf`` for the next :meth:`step_after_unscale` (or plain ``step()``) and
        moves the scale: back off on overflow, grow after ``growth_interval`` clean steps. No
        host sync when ``grads_scaled_by`` is ``opt.scale`` or a Python float.

        Args:
            grads_scaled_by: the scale the loss was multiplied by, or ``None`` when the grads
                are not scaled (nothing is unscaled, nothing will be skipped).

        Returns:
            ``(found_inf, recommended_scale)``: ``found_inf`` is a 0-dim float32 tensor (1.0 if
            any grad was inf/nan); ``recommended_scale`` is :attr:`scale` (``None`` if
            ``grads_scaled_by`` was ``None``).

        fp16 grads are refused, as :meth:`torch.amp.GradScaler.unscale_` refuses them: unscaled
        in place they cannot hold small grads (below 6e-8 they flush to zero), and a clipped run
        drifts from fp32. A fused optimizer's :meth:`unscale_and_step` unscales them in fp32
        inside the update, and clips them there with ``max_grad_norm``; one whose own ``step()``
        reads the grads (:func:`~scaledoptim.with_scaling`) refuses them at every scaled step.
        bf16 grads have float32's range.

        Raises:
            RuntimeError: if called twice without a step (or ``zero_grad``) in between, for
                grads on another device than the scale, a scale tensor no longer in use (the
                concepts guide's "S = opt.scale stays the scale in use"), ``None`` after a
                backward scaled by :attr:`scale`, or an optimizer a GradScaler steps.
            ValueError: if the scale is not finite and positive, or for fp16 grads.
        """
        state = steps.own_state(self, "unscale")
        steps.check_can_unscale(state, grads_scaled_by, id(self))
        plan = steps.plan(self)  # the step it prepares must be possible too
        request = steps.validate_request(self, state, grads_scaled_by)
        found_inf = split_form.unscale(self, request, plan).found_inf
        assert found_inf is not None  # the check always makes one
        return found_inf, None if request.scaled_by is None else state.loss_scale.scale

    @compile_boundary.disable  # See Note [compile boundary]
    def step_after_unscale(
        self,
        closure: Callable[[Any], tuple[Any, torch.Tensor, Any]] | None = None,
        current_grad_scale: torch.Tensor | float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None] | None:
        r"""Steps with the grads :meth:`unscale` left, skipping the step if it found inf/nan.

        Without a closure: consumes the ``found_inf`` recorded by :meth:`unscale` and returns
        ``None``. Fused optimizers skip on device; a generic ``step()`` costs one host read.

        With a closure: ``closure(S)`` must zero the grads, run a backward scaled by ``S``, call
        ``opt.unscale(grads_scaled_by=S)`` itself (to clip or inspect the grads) and return
        ``(loss, found_inf, S)`` as :meth:`unscale` gave them; it is replayed with the
        backed-off ``S`` until its grads are finite (one host read per call).

        Args:
            closure: optional, see above.
            current_grad_scale: the scale passed to the closure's first call.

        Returns:
            ``None`` without a closure; ``(loss, found_inf, S)`` with one.

        Raises:
            RuntimeError: without a closure, if :meth:`unscale` was not called first.
            ClosureReplayError: if the closure's grads stay non-finite; nothing is changed.
        """
        steps.own_state(self, "step_after_unscale")
        if closure is not None:
            return replay.step_after_unscale(self, closure, current_grad_scale)
        steps.run_step(self, split_form.validate_pending(self))
        return None

    def _plan_step(self, run: Callable[[], Any] | None = None) -> StepPlan:
        """Validates everything a step will need and returns it, ready to run; changes nothing.
        The hook a subclass answers; this generic plan runs ``run`` (``self.step()`` when
        ``None``), skipped after a host read of ``found_inf`` (``plans.py``)."""
        check_param_groups(self)
        return GenericStepPlan(self, run)

    def _overlapped_check(self, device: torch.device) -> GradCheck | None:
        """How ``check_during_backward`` folds a grad on ``device`` into ``found_inf`` as backward
        produces it, or ``None`` when that saves nothing: a generic step unscales, and so
        checks, every grad in place anyway."""
        return None

    #: torch's "my step() reads ``grad_scale`` and ``found_inf``" (Note [torch GradScaler]), and
    #: what a plain step() owes the protocol (Note [step requests]): both in guard.py.
    _step_supports_amp_scaling = guard.AMP_SCALING
    _implicit_request = guard.implicit_request

    # ------------------------------------------------------------------ configuration
    def configure_scaling(
        self: _Self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        # Literals, not ScalingConfig's attributes: the API reference renders the source of a
        # default, and a reader wants the value (a test checks that the two agree).
        min_scale: float = 1.1754943508222875e-38,
        max_scale: float = 3.4028234663852886e38,
        max_replays: int = 32,
        process_group: Any = None,
        check_during_backward: bool = False,
        grads_across_ranks: str | None = None,
    ) -> _Self:
        r"""Sets the dynamic loss scale's hyper-parameters and resets it to ``init_scale``.

        The defaults reproduce :class:`torch.amp.GradScaler`'s scale sequence exactly
        (:class:`scaledoptim.ScalingConfig` checks the values). The new scale is written into
        :attr:`scale`'s tensor: a handle taken before stays live.

        Args:
            init_scale: the scale before the first step. Default: ``2**16``.
            growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
                Default: ``2.0``.
            backoff_factor: multiplies the scale when an overflow is not tolerated (in (0, 1)).
                Default: ``0.5``.
            growth_interval: consecutive clean steps before the scale grows; ``2**31`` or more
                never grows it. Default: ``2000``.
            hysteresis: consecutive overflows needed before the scale backs off; ``N``
                tolerates ``N - 1``. Default: ``1`` (back off on every overflow, as GradScaler).
            min_scale: the scale never backs off below this. Default: the smallest normal
                float32 (about ``1.2e-38``).
            max_scale: the scale never grows above this. Default: the largest float32 (about
                ``3.4e38``).
            max_replays: how many times a closure may be replayed with a smaller scale in one
                step before :class:`~scaledoptim.ClosureReplayError` is raised. Default: ``32``.
            process_group: a :class:`torch.distributed.ProcessGroup` whose ranks must agree on
                overflow (DDP, FSDP, sharded optimizers): ``found_inf`` is all-reduced (MAX) over
                it on device before the scale moves or anything steps, so every rank skips and
                moves its scale alike; every rank must unscale once per iteration. Default:
                ``None`` (single process).
            grads_across_ranks: how the plain (non-DTensor) grads relate across
                ``process_group``'s ranks, for clipping in the step: ``"replicated"`` (DDP: the
                norm is this rank's) or ``"sharded"`` (each rank's optimizer holds its own part
                of the model: the ranks' sums of squares are added). DTensor grads need neither.
                Default: ``None``: clipping under ``process_group`` with plain params is refused.
            check_during_backward: fold each grad into ``found_inf`` as backward produces it,
                so that the step on our kernels reads each grad once instead of twice (the
                concepts page says when it helps); nothing once torch.distributed is
                initialized. Not kept in the ``state_dict`` or in copies. Default: ``False``.

        Returns:
            the optimizer itself, so ``opt = AdamW(...).configure_scaling(...)`` reads well.

        Raises:
            RuntimeError: on an optimizer that shares its scale (configure the first, then
                share), or one a :class:`scaledoptim.GradScaler` steps (configure the scaler).
            ValueError: ``grads_across_ranks`` other than ``None``, ``"replicated"`` or
                ``"sharded"``, or given without ``process_group``.
        """
        options = dict(locals())  # every argument, named as ScalingConfig names its fields
        scaling.configure(options.pop("self"), **options)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also drops a pending step (after
        :meth:`unscale`), what ``check_during_backward`` folded from the grads it drops, and on
        a shared scale lets the next unscale end a round this optimizer's iteration abandoned."""
        super().zero_grad(set_to_none)
        state = self._scaledoptim_scaling
        if state is not None:
            state.pending = None
            if state.loss_scale.sharers > 1:
                state.loss_scale.end_round(id(self))
        if self._scaledoptim_backward_check is not None:
            self._scaledoptim_backward_check.reset()

    # ------------------------------------------------------------------ checkpoints and copies
    def state_dict(self) -> dict[str, Any]:
        """As :meth:`torch.optim.Optimizer.state_dict`, plus ``"loss_scale"``: the scale, its
        growth and hysteresis trackers and its config (loading it resumes bit for bit). Each
        param group holds a copy, which ``get_optimizer_state_dict`` keeps, so a DCP checkpoint
        carries the scale too. The process group is not saved: it belongs to the run.

        Raises:
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale`: no state_dict
                holds the pending step's unscaled grads. Save before or after.
        """
        scaling.check_between_steps(self._scaledoptim_scaling, "state_dict()")
        state_dict = super().state_dict()
        loss_scale = self._scaling().loss_scale
        state_dict["loss_scale"] = loss_scale.state_dict()
        # See Note [the scale through DCP] in scale_carrying.py
        for group in state_dict["param_groups"]:
            group[GROUP_SCALE_KEY] = loss_scale.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, restoring the loss scale too.

        A plan, then a commit, as a step: the load-state-dict pre-hooks run on the state_dict
        given (they may replace it), then its layout, every value the optimizer will read and
        the scale state are validated; only then is anything installed, and the post-hooks run.
        A refusal names the key and the fix and changes nothing.

        The scale state is the top-level ``"loss_scale"``, or else the copy every param group
        holds (they must agree). A plain ``torch.optim`` state_dict loads with the scale reset
        to the configured ``init_scale`` (a :class:`scaledoptim.GradScaler`'s optimizer keeps
        the scaler's). The scale is copied into :attr:`scale`'s tensor; the process group stays.

        Raises:
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale` (see
                :meth:`state_dict`).
            TypeError, ValueError: a state_dict this optimizer did not write, or one whose
                values its next step would reject or turn into NaN, naming the key.
        """
        scaling.load(self, state_dict, super().load_state_dict)

    def _plan_load_state(
        self, state_dict: dict[str, Any], by_id: dict[Hashable, torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, Any]] | None:
        """Validates the param groups and per-param state of ``state_dict`` (layout checked,
        ``by_id``: the param each saved id stands for) and returns the state to install, or
        ``None`` to let torch's loader cast and install it (a generic optimizer's state is
        torch's business). Changes nothing. The hook an optimizer that knows its state
        answers (the fused ones)."""
        return None

    def load_gradscaler_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues a :class:`torch.amp.GradScaler`'s scale: loads ``scaler.state_dict()``.

        Takes its scale, growth tracker, growth/backoff factors and growth interval, and keeps
        this optimizer's hysteresis, bounds and process group: with their defaults the run
        continues GradScaler's scale sequence. Validated before anything changes.

        Raises:
            TypeError, ValueError: for anything but a valid enabled GradScaler's state_dict.
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale`, or on a
                shared scale.
        """
        scaling.load_gradscaler_state(self, state_dict)

    def gradscaler_state_dict(self) -> dict[str, Any]:
        """The scale as ``torch.amp.GradScaler.state_dict()`` holds it (to go back to GradScaler).

        Reads the scale on the host; warns if hysteresis or scale bounds are configured.

        Raises:
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale`.
        """
        scaling.check_between_steps(self._scaledoptim_scaling, "gradscaler_state_dict()")
        return gradscaler_state_from_loss_scale(self._scaling().loss_scale)

    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups: a copy, pickle
    # or torch.save(opt) would come back with a fresh scale. Not kept: the process group
    # (configure the copy with its own) and sharing (share the copies again).
    __getstate__ = scaling.getstate
    __setstate__ = scaling.setstate
