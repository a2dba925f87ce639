"""The loss-scaling protocol, inherited by every scaledoptim optimizer.

Note [found_inf contract]
~~~~~~~~~~~~~~~~~~~~~~~~~
``found_inf`` is a 0-dim float32 tensor on the params' device, 0.0 when every grad was finite and
1.0 otherwise (after a distributed MAX it is still 0.0 or 1.0). It is produced by ``unscale`` and
consumed by the step: a fused update reads it *on device* and, when it is non-zero, changes
nothing at all -- not params, not moments, not step counters -- so no host ever has to look at
it. Only the generic fallback (an arbitrary ``step()`` we cannot see into) reads it on the host,
once per step. The kernels in ``cuda/`` and the torch-native path in ``optim/_native.py`` both
follow this contract; ``tests/test_protocol.py`` holds them to it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._checks import as_scale_tensor, check_param_grads
from .distributed import agree_on_found_inf, check_process_group
from .gradscaler_state import gradscaler_state_from_loss_scale, loss_scale_from_gradscaler_state
from .scaling import LossScale, ScalingConfig

__all__ = ["Optimizer", "ClosureReplayError", "share_scale"]

_Self = TypeVar("_Self", bound="Optimizer")
_READY, _UNSCALED = "ready", "unscaled"


class ClosureReplayError(RuntimeError):
    """A closure kept producing non-finite grads after every allowed replay.

    When it is raised, params, optimizer state and the loss scale are exactly as they were before
    the call that raised it.
    """


@dataclasses.dataclass
class _ScalingState:
    loss_scale: LossScale
    stage: str = _READY
    found_inf: torch.Tensor | None = None
    # Set when the grads were checked but left scaled: the step multiplies them by it in
    # registers (our fused kernels fold the unscale into the update).
    pending_inv_scale: torch.Tensor | None = None
    replaying: bool = False
    # Not part of the state_dict: a process group belongs to this run, not to the checkpoint.
    process_group: Any = None

    def record_unscale(self, found_inf: torch.Tensor, pending_inv_scale: torch.Tensor | None) -> None:
        self.stage, self.found_inf, self.pending_inv_scale = _UNSCALED, found_inf, pending_inv_scale

    def forget_unscale(self) -> None:
        self.stage, self.found_inf, self.pending_inv_scale = _READY, None, None


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

    # Per-instance bookkeeping lives under this attribute so that classes made by
    # ``with_scaling`` (whose ``__init__`` we do not own) and patched instances get it lazily.
    _SCALING_ATTR = "_scaledoptim_scaling"

    # ------------------------------------------------------------------ scale state
    def _scaling(self) -> _ScalingState:
        state = self.__dict__.get(self._SCALING_ATTR)
        if state is None:
            state = _ScalingState(LossScale(ScalingConfig(), self._params_device()))
            self.__dict__[self._SCALING_ATTR] = state
        return state

    def _params_device(self) -> torch.device:
        for group in self.param_groups:
            for param in group["params"]:
                return param.device
        raise RuntimeError("The optimizer holds no parameters, so it has no device for its scale")

    @property
    def scale(self) -> torch.Tensor:
        """The current recommended loss scale: a 0-dim float32 tensor on the params' device.

        It is updated in place by :meth:`unscale`; ``opt.scale.clone()`` keeps a snapshot.
        """
        return self._scaling().loss_scale.scale

    def configure_scaling(
        self: _Self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = ScalingConfig.min_scale,
        max_scale: float = ScalingConfig.max_scale,
        max_replays: int = ScalingConfig.max_replays,
        process_group: Any = None,
    ) -> _Self:
        r"""Sets the dynamic loss scale's hyper-parameters and resets it to ``init_scale``.

        The defaults reproduce :class:`torch.amp.GradScaler`'s scale sequence exactly. See
        :class:`scaledoptim.scaling.ScalingConfig` for the other arguments.

        Args:
            process_group: a :class:`torch.distributed.ProcessGroup` whose ranks must agree on
                overflow (DDP, FSDP, sharded optimizers). Every :meth:`unscale` then all-reduces
                ``found_inf`` with MAX over it, on device with no host read, before the scale
                moves or anything steps: if one rank overflows, every rank skips and every
                rank's scale moves the same way. Every rank of the group must unscale once per
                iteration. ``None`` (default): no agreement (single process).

        Returns:
            the optimizer itself, so ``opt = AdamW(...).configure_scaling(...)`` reads well.
        """
        check_process_group(process_group)
        config = ScalingConfig(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            max_replays=max_replays,
        )
        current = self.__dict__.get(self._SCALING_ATTR)
        if current is not None and current.loss_scale.sharers > 1:
            raise RuntimeError(
                "configure_scaling() on an optimizer that shares its scale: configure the first "
                "optimizer, then call scaledoptim.share_scale(...)"
            )
        self.__dict__[self._SCALING_ATTR] = _ScalingState(
            LossScale(config, self._params_device()), process_group=process_group
        )
        return self

    # ------------------------------------------------------------------ the protocol
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

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
        scale, grads = self._begin_unscale(grads_scaled_by)
        found_inf = self._no_overflow()
        if scale is None:
            return self._finish_unscale(None, found_inf)
        inv_scale = scale.double().reciprocal().float()  # as GradScaler computes it
        for same_dtype in _group_by_dtype(grads):
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
        return self._finish_unscale(scale, found_inf)

    def _begin_unscale(
        self, grads_scaled_by: torch.Tensor | float | None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Validates an unscale before anything changes; returns the scale tensor and the grads."""
        state = self._scaling()
        if state.stage == _UNSCALED:
            raise RuntimeError(
                "unscale() was already called since the last step: the grads are unscaled "
                "already. Call step_after_unscale() (or zero_grad() and a new backward) first."
            )
        device = state.loss_scale.device
        check_param_grads(
            (p for g in self.param_groups for p in g["params"] if p.grad is not None), device
        )
        grads = self._grads()
        if grads_scaled_by is None:
            return None, grads
        scale = as_scale_tensor(grads_scaled_by, device, trusted=state.loss_scale.scale)
        state.loss_scale.check_can_report(id(self))
        return scale, grads

    def _finish_unscale(
        self,
        scale: torch.Tensor | None,
        found_inf: torch.Tensor,
        pending_inv_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Agrees on ``found_inf`` across the process group, moves the scale on it and records it
        for the step (no host sync). Every unscale path ends here; one that left the grads
        scaled passes the ``pending_inv_scale`` the step must apply."""
        state = self._scaling()
        if scale is None:
            state.record_unscale(found_inf, None)
            return found_inf, None
        if state.process_group is not None:
            try:
                agree_on_found_inf(found_inf, state.process_group)  # before anything uses it
            except BaseException:
                # The grads may already be unscaled in place, so a second unscale() must be
                # refused; and this rank cannot know whether another overflowed: skip the step.
                found_inf.fill_(1.0)
                state.record_unscale(found_inf, pending_inv_scale)
                raise
        state.record_unscale(found_inf, pending_inv_scale)
        state.loss_scale.report(id(self), scale, found_inf, force_backoff=state.replaying)
        return found_inf, state.loss_scale.scale

    def step_after_unscale(
        self,
        closure: Callable[[Any], tuple[Any, torch.Tensor, Any]] | None = None,
        current_grad_scale: torch.Tensor | float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None] | None:
        r"""Steps with the grads :meth:`unscale` left, skipping the step if it found inf/nan.

        Without a closure: consumes the ``found_inf`` recorded by :meth:`unscale` and returns
        ``None``. Fused optimizers skip on device; a generic ``step()`` costs one host read.

        With a closure (the seed's second form): ``closure(S)`` must zero the grads, run the
        forward and a backward scaled by ``S``, call ``opt.unscale(grads_scaled_by=S)`` itself
        (so it can clip or inspect the grads) and return ``(loss, found_inf, S)`` as
        :meth:`unscale` gave them. It is replayed with the backed-off ``S`` until its grads are
        finite (one host read per call), and ``self.step`` only ever sees finite grads.

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
            _check_callable(closure, "step_after_unscale", "current_grad_scale")
            return self._step_replaying(
                lambda scale: self._checked_closure_result(closure(scale)), current_grad_scale
            )
        state = self._scaling()
        if state.stage != _UNSCALED:
            raise RuntimeError(
                "step_after_unscale() needs the grads unscaled first: call "
                "opt.unscale(grads_scaled_by=S) after backward, or use opt.unscale_and_step()."
            )
        self._step_skipping_if(state.found_inf)
        state.forget_unscale()
        return None

    def unscale_and_step(
        self,
        closure: Callable[[Any], Any] | None = None,
        grads_scaled_by: torch.Tensor | float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        r"""Unscales the grads and steps, skipping the step on inf/nan.

        Without a closure: :meth:`unscale` then :meth:`step_after_unscale`, with no host sync on
        fused optimizers. With ``closure(S) -> loss`` (which zeroes the grads and runs a
        backward scaled by ``S``): the closure is wrapped so that every call unscales and, on
        inf/nan, replays with the backed-off scale; ``self.step`` sees only the wrapped closure,
        so optimizers that evaluate it many times (LBFGS) get finite grads every time. Every
        closure evaluation counts as one step of the scale's state machine.

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
        """
        if closure is None:
            if grads_scaled_by is None:
                self.step()
                return None, self._no_overflow(), None
            found_inf, scale = self.unscale(grads_scaled_by)
            self.step_after_unscale()
            return None, found_inf, scale
        _check_callable(closure, "unscale_and_step", "grads_scaled_by")
        if grads_scaled_by is None:
            loss = self.step(lambda: closure(None))
            return loss, self._no_overflow(), None
        return self._step_replaying(
            lambda scale: (closure(scale), *self.unscale(grads_scaled_by=scale)), grads_scaled_by
        )

    def _checked_closure_result(self, result: Any) -> tuple[Any, torch.Tensor, Any]:
        if not (
            isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], torch.Tensor)
        ) or self._scaling().stage != _UNSCALED:
            raise TypeError(
                "A closure given to step_after_unscale() must call opt.unscale(grads_scaled_by=S) "
                "and return (loss, found_inf, S) as unscale() returned them; got "
                f"{type(result).__name__}. For a closure that only returns the loss, use "
                "unscale_and_step(closure, grads_scaled_by=S)."
            )
        return result

    def _no_overflow(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=self._scaling().loss_scale.device)

    def _step_skipping_if(self, found_inf: torch.Tensor) -> None:
        """Runs ``self.step()`` unless ``found_inf`` is set. Fused subclasses do it on device.

        See Note [found_inf contract]. This generic version reads ``found_inf`` on the host,
        except for optimizers that implement torch's own on-device ``found_inf`` protocol.
        """
        if getattr(self, "_step_supports_amp_scaling", False):
            self.grad_scale, self.found_inf = None, found_inf
            try:
                self.step()
            finally:
                del self.grad_scale, self.found_inf
        elif found_inf.item() == 0.0:
            self.step()

    def _step_replaying(
        self,
        evaluate: Callable[[Any], tuple[Any, torch.Tensor, torch.Tensor | None]],
        first_scale: torch.Tensor | float | None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        state = self._scaling()
        if state.stage == _UNSCALED:
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
            for attempt in range(max_replays + 1):
                state.forget_unscale()
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
                f"The closure produced inf/nan grads on all {attempt + 1} tries (the scale backed "
                f"off to {next_value:g}): the loss itself is probably non-finite (check the data "
                "and the forward), or raise configure_scaling(max_replays=...) / lower "
                "min_scale. Params, optimizer state and the loss scale were restored."
            )

        snapshot = self._snapshot()
        state.replaying = True
        try:
            loss = self.step(replaying_closure)
        except BaseException:
            self._restore(snapshot)
            raise
        finally:
            state.replaying = False
            state.forget_unscale()
        return loss, outcome["found_inf"], outcome["scale"]

    # ------------------------------------------------------------------ snapshots
    def _snapshot(self) -> tuple[list[torch.Tensor], dict[Any, Any], dict[str, Any]]:
        params = [p.detach().clone() for g in self.param_groups for p in g["params"]]
        opt_state = {p: copy.deepcopy(s) for p, s in self.state.items()}
        return params, opt_state, self._scaling().loss_scale.state_dict()

    @torch.no_grad()
    def _restore(self, snapshot: tuple[list[torch.Tensor], dict[Any, Any], dict[str, Any]]) -> None:
        params, opt_state, scale_state = snapshot
        for param, saved in zip((p for g in self.param_groups for p in g["params"]), params):
            param.copy_(saved)
        self.state.clear()
        self.state.update(opt_state)
        loss_scale = self._scaling().loss_scale
        for name in ("scale", "growth_tracker", "hysteresis_tracker"):
            getattr(loss_scale, name).copy_(scale_state[name])

    # ------------------------------------------------------------------ torch.optim overrides
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; also forgets an unconsumed :meth:`unscale`."""
        super().zero_grad(set_to_none)
        state = self.__dict__.get(self._SCALING_ATTR)
        if state is not None:
            state.forget_unscale()

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`torch.optim.Optimizer.state_dict`, plus ``"loss_scale"``: the scale, its
        growth and hysteresis trackers and its config. Loading it resumes bit for bit.

        The process group given to :meth:`configure_scaling` is not saved (it belongs to the
        run): configure the resumed optimizer with its own, then load.

        Raises:
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale`. A checkpoint
                taken there could not resume exactly: the pending step needs the unscaled grads,
                which no optimizer state_dict holds, and the scale has already moved for it.
                Save before :meth:`unscale` or after the step.
        """
        self._check_between_steps("state_dict()")
        state_dict = super().state_dict()
        state_dict["loss_scale"] = self._scaling().loss_scale.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, restoring the loss scale too.

        A plain ``torch.optim`` state_dict (no ``"loss_scale"``) loads with this optimizer's
        scale reset to its configured ``init_scale``. The scale state is validated before
        anything changes. The process group given to :meth:`configure_scaling` is kept.

        Raises:
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale` (see
                :meth:`state_dict`).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        self._check_between_steps("load_state_dict()")
        state_dict = dict(state_dict)
        scale_state = state_dict.pop("loss_scale", None)
        device = self._params_device()
        current = self._scaling()
        if current.loss_scale.sharers > 1:
            raise RuntimeError(
                "load_state_dict() on an optimizer that shares its scale: load every optimizer, "
                "then call scaledoptim.share_scale(...) again"
            )
        loss_scale = (
            LossScale(current.loss_scale.config, device)
            if scale_state is None
            else LossScale.from_state_dict(scale_state, device)
        )
        super().load_state_dict(state_dict)
        self.__dict__[self._SCALING_ATTR] = _ScalingState(
            loss_scale, process_group=current.process_group
        )

    def _check_between_steps(self, method: str) -> None:
        state = self.__dict__.get(self._SCALING_ATTR)
        if state is not None and state.stage == _UNSCALED:
            raise RuntimeError(
                f"{method} was called between unscale() and step_after_unscale(): a checkpoint "
                "cannot hold the pending step (its unscaled grads are not optimizer state). Call "
                "step_after_unscale() (or zero_grad() to drop the step) first."
            )

    # ------------------------------------------------------------------ torch.amp.GradScaler state
    def load_gradscaler_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues a :class:`torch.amp.GradScaler`'s scale: loads ``scaler.state_dict()``.

        Takes its scale, growth tracker, growth/backoff factors and growth interval; keeps this
        optimizer's hysteresis, scale bounds and process group. With their defaults the run
        continues the scale sequence GradScaler would have produced. Validated before anything
        changes.

        Raises:
            TypeError, ValueError: for anything but a valid enabled GradScaler's state_dict.
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale`, or on a
                shared scale.
        """
        self._check_between_steps("load_gradscaler_state_dict()")
        current = self._scaling()
        if current.loss_scale.sharers > 1:
            raise RuntimeError(
                "load_gradscaler_state_dict() on a shared scale: load it into each optimizer, "
                "then call scaledoptim.share_scale(...) again"
            )
        loaded = loss_scale_from_gradscaler_state(
            state_dict, current.loss_scale.config, self._params_device()
        )
        state = _ScalingState(loaded, process_group=current.process_group)
        self.__dict__[self._SCALING_ATTR] = state

    def gradscaler_state_dict(self) -> dict[str, Any]:
        """The scale as ``torch.amp.GradScaler.state_dict()`` holds it (to go back to GradScaler).

        Reads the scale on the host. Warns if hysteresis or scale bounds are configured
        (GradScaler has neither).

        Raises:
            RuntimeError: between :meth:`unscale` and :meth:`step_after_unscale`.
        """
        self._check_between_steps("gradscaler_state_dict()")
        return gradscaler_state_from_loss_scale(self._scaling().loss_scale)


def share_scale(*optimizers: Optimizer) -> torch.Tensor:
    r"""Makes several optimizers share one dynamic loss scale; returns it.

    The first optimizer's configuration is used and the shared scale starts from its
    ``init_scale``. Each optimizer still skips its own step when *its* grads overflow (as
    :class:`torch.amp.GradScaler` does); the scale moves once per iteration, after every
    optimizer has called :meth:`Optimizer.unscale` (or :meth:`Optimizer.unscale_and_step`),
    backing off if any of them found inf/nan.

    Example::

        >>> S = scaledoptim.share_scale(opt_g, opt_d)
        >>> scaledoptim.scale_outputs(loss_g + loss_d, S).backward()
        >>> for opt in (opt_g, opt_d):
        ...     _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """
    if len(optimizers) < 2:
        raise ValueError("share_scale() needs at least two optimizers")
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"{type(opt).__name__} has no loss-scaling protocol; wrap it with "
                "scaledoptim.patch_optimizer(opt) first"
            )
    devices = {opt._params_device() for opt in optimizers}
    if len(devices) > 1:
        raise RuntimeError(f"Optimizers sharing a scale must share a device, got {devices}")
    shared = LossScale(optimizers[0]._scaling().loss_scale.config, devices.pop())
    shared.sharers = len(optimizers)
    for opt in optimizers:
        process_group = opt._scaling().process_group
        opt.__dict__[Optimizer._SCALING_ATTR] = _ScalingState(shared, process_group=process_group)
    return shared.scale


def _check_callable(closure: Any, method: str, scale_keyword: str) -> None:
    # A scale passed positionally lands in ``closure``: say so instead of failing inside step().
    if not callable(closure):
        raise TypeError(
            f"{method}() takes a closure(S) function or None as its first argument, got "
            f"{type(closure).__name__}; pass the scale by keyword: {method}({scale_keyword}=S)"
        )


def _group_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())
