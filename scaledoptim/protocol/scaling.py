"""An optimizer's loss scale over its life: configured, loaded from a checkpoint (planned before
anything is installed: Note [loads are plans] in loads.py), carried by a copy, and a handle to it
kept live through all of them (Note [scale handles] in scale/loss_scale.py). The methods of
:class:`~scaledoptim.Optimizer` that do these call the functions here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .. import compile_boundary
from ..scale import (
    LossScale,
    ScalingConfig,
    check_process_group,
    loss_scale_from_gradscaler_state,
)
from ..torch_ops import refuse_during_capture
from .backward_check import BackwardCheck
from .clipping import check_grads_across_ranks
from .loads import check_layout, nothing_loaded_on_failure
from .scale_carrying import _carries_scale, _pop_group_scale_state
from .values import GradPass

__all__ = [
    "ScalingState",
    "adopt_scale",
    "check_between_steps",
    "configure",
    "create",
    "getstate",
    "keep_handle",
    "load",
    "load_gradscaler_state",
    "setstate",
]


@dataclasses.dataclass
class ScalingState:
    """One optimizer's loss scale (possibly shared) and its place in the protocol."""

    loss_scale: LossScale
    # The step checked and decided whose update has not run: after unscale(), or kept by a step
    # that failed (Note [atomic step]); None between steps. The protocol's stage is this field.
    pending: GradPass | None = None
    # Set while closure replay runs: every overflow backs off, hysteresis notwithstanding.
    replaying: bool = False
    # Not part of the state_dict: a process group belongs to this run, not to the checkpoint.
    process_group: Any = None
    # How the grads relate across process_group's ranks, for clipping: "replicated" (DDP) or
    # "sharded"; None: not said (Note [clipping in the step] in clipping.py). Not saved either.
    grads_across_ranks: str | None = None
    # The scaledoptim.GradScaler that moves the scale (its name, for messages), if any.
    driver: str | None = None
    # The scale came from a checkpoint (a GradScaler that adopts it warns if its own was not).
    loaded: bool = False

    @property
    def unscaled(self) -> bool:
        """Whether a step is pending (between ``unscale()`` and its step)."""
        return self.pending is not None


def configure(
    optimizer: Any,
    *,
    process_group: Any,
    check_during_backward: bool,
    grads_across_ranks: str | None,
    **config: Any,
) -> None:
    """``optimizer.configure_scaling(...)``: a new scale of ``config`` in the tensors of the one
    in use, the process group, the clip's layout and the backward check; refused (nothing
    changed) for bad values, a shared scale or one a GradScaler moves."""
    check_process_group(process_group)
    check_grads_across_ranks(grads_across_ranks, process_group)
    scaling_config = ScalingConfig(**config)
    current = optimizer._scaledoptim_scaling
    if current is not None and current.loss_scale.sharers > 1:
        raise RuntimeError(
            "configure_scaling() on an optimizer that shares its scale: configure the first "
            "optimizer, then call scaledoptim.share_scale(...)"
        )
    if current is not None and current.driver is not None:
        raise RuntimeError(
            f"configure_scaling() on an optimizer stepped by a {current.driver}, which owns "
            "its scale: configure the scaler (its constructor, set_growth_factor(), ...)"
        )
    optimizer._scaledoptim_scaling = ScalingState(
        keep_handle(current, LossScale(scaling_config, optimizer._params_device())),
        process_group=process_group,
        grads_across_ranks=grads_across_ranks,
    )
    if optimizer._scaledoptim_backward_check is not None:
        optimizer._scaledoptim_backward_check.remove()
    optimizer._scaledoptim_backward_check = (
        BackwardCheck(
            optimizer.param_groups, optimizer._overlapped_check, lambda: optimizer.scale
        )
        if check_during_backward
        else None
    )


def load_gradscaler_state(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_gradscaler_state_dict(state_dict)``, validated first."""
    current = _loadable(optimizer, "load_gradscaler_state_dict")
    loaded = loss_scale_from_gradscaler_state(
        state_dict, current.loss_scale.config, optimizer._params_device()
    )
    current.loss_scale = keep_handle(current, loaded)
    current.loaded = True


def _loadable(optimizer: Any, method: str) -> ScalingState:
    """The optimizer's state, refusing a load between ``unscale()`` and its step, or into a
    shared scale."""
    current = optimizer._scaling()
    check_between_steps(current, f"{method}()")
    if current.loss_scale.sharers > 1:
        raise RuntimeError(
            f"{method}() on an optimizer that shares its scale: load every optimizer, then call "
            "scaledoptim.share_scale(...) again"
        )
    return current


def check_between_steps(state: ScalingState | None, method: str) -> None:
    """Refuses a checkpoint between ``unscale()`` and the step that consumes it."""
    if state is not None and state.unscaled:
        raise RuntimeError(
            f"{method} was called between unscale() and step_after_unscale(): a checkpoint "
            "cannot hold the pending step (its unscaled grads are not optimizer state). Call "
            "step_after_unscale() (or zero_grad() to drop the step) first."
        )


def keep_handle(state: ScalingState | None, loaded: LossScale) -> LossScale:
    """The LossScale to use for ``loaded`` (validated, nothing changed yet): the one in use,
    holding ``loaded``'s state in its own tensors, so that ``S = opt.scale`` taken before stays
    the scale in use (Note [scale handles]); ``loaded`` itself when there is none yet, or when the
    params moved to another device (the old scale is then retired)."""
    if state is None:
        return loaded
    if state.loss_scale.assign_(loaded):
        return state.loss_scale
    state.loss_scale.retire(
        f"This scale tensor lived on {state.loss_scale.device}, but the optimizer's params "
        f"moved to {loaded.device}, and so did its scale: pass opt.scale as it is now."
    )
    return loaded


def load(
    optimizer: Any,
    state_dict: dict[str, Any],
    torch_load: Callable[[dict[str, Any]], None],
) -> None:
    """``optimizer.load_state_dict(state_dict)`` planned, then committed: the pre-hooks, every
    check (the layout, the values the optimizer plans to install, the scale), torch's loader
    (``torch_load``, without hooks), the planned state and scale, the post-hooks."""
    hooks = optimizer.__dict__
    pre_hooks = hooks["_optimizer_load_state_dict_pre_hooks"]
    post_hooks = hooks["_optimizer_load_state_dict_post_hooks"]
    for pre_hook in list(pre_hooks.values()):
        replaced = pre_hook(optimizer, state_dict)
        if replaced is not None:
            state_dict = replaced
    by_id = check_layout(optimizer, state_dict)
    loss_scale, torch_state_dict = _split_scale_state(optimizer, state_dict)
    planned = optimizer._plan_load_state(torch_state_dict, by_id)
    if planned is not None:  # torch's loader gets no state: it is installed as planned
        torch_state_dict = {**torch_state_dict, "state": {}}
    # torch's loader gets no hooks: they ran above, and run below once all is in place.
    hooks["_optimizer_load_state_dict_pre_hooks"] = type(pre_hooks)()
    hooks["_optimizer_load_state_dict_post_hooks"] = type(post_hooks)()
    try:
        with nothing_loaded_on_failure(optimizer):
            torch_load(torch_state_dict)
    finally:
        hooks["_optimizer_load_state_dict_pre_hooks"] = pre_hooks
        hooks["_optimizer_load_state_dict_post_hooks"] = post_hooks
    if planned is not None:
        optimizer.state.update(planned)
    state = optimizer._scaling()
    if loss_scale is not None:  # None: a plain torch.optim state_dict into a GradScaler's
        state.loss_scale = keep_handle(state, loss_scale)
        state.loaded = "loss_scale" in state_dict or _carries_scale(state_dict)
    state.pending = None
    for post_hook in list(post_hooks.values()):
        post_hook(optimizer)


def _split_scale_state(
    optimizer: Any, state_dict: dict[str, Any]
) -> tuple[LossScale | None, dict[str, Any]]:
    """Validates ``state_dict``'s ``"loss_scale"`` and returns it as a :class:`LossScale` with
    the rest of the state_dict; changes nothing. A state_dict without one (a plain torch.optim
    checkpoint) gives a fresh scale of the optimizer's configuration, or ``None`` for an
    optimizer a GradScaler steps (its scale is the scaler's, loaded with the scaler)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    current = _loadable(optimizer, "load_state_dict")
    state_dict = dict(state_dict)
    group_scale_state = _pop_group_scale_state(state_dict)
    given = "loss_scale" in state_dict
    scale_state = state_dict.pop("loss_scale", group_scale_state)
    if given and scale_state is None:
        raise TypeError(
            "Corrupt optimizer state_dict: 'loss_scale' is None. Load the 'loss_scale' "
            "state_dict() wrote, or delete the key to start from the configured init_scale"
        )
    device = optimizer._params_device()
    if scale_state is None:
        if current.driver is not None:
            return None, state_dict  # the scaler's scale is the one in use: leave it
        return LossScale(current.loss_scale.config, device), state_dict
    return LossScale.from_state_dict(scale_state, device), state_dict


# Created eagerly even when first touched inside torch.compile: a scale created while tracing
# could be a different tensor from the one the protocol moves, and then the scale the next
# compiled call reads never backs off.
@compile_boundary.disable
def create(optimizer: Any) -> ScalingState:
    """The optimizer's scale and protocol state, made on first use (on its params' device)."""
    refuse_during_capture("Creating the loss scale")
    state = ScalingState(LossScale(ScalingConfig(), optimizer._params_device()))
    optimizer._scaledoptim_scaling = state
    return state


_PICKLED = "_scaledoptim_pickled_scaling"


def getstate(optimizer: Any) -> dict[str, Any]:
    """``Optimizer.__getstate__``: torch's state plus the loss scale (scale, trackers, config) and
    the ``found_inf`` of a pending step."""
    state = torch.optim.Optimizer.__getstate__(optimizer)
    scaling = optimizer._scaledoptim_scaling
    if scaling is not None:
        pending = scaling.pending
        found_inf = None if pending is None else pending.found_inf
        state[_PICKLED] = {
            "loss_scale": scaling.loss_scale.state_dict(),
            "found_inf": None if found_inf is None else found_inf.clone(),
        }
    return state


def setstate(optimizer: Any, state: dict[str, Any]) -> None:
    """``Optimizer.__setstate__``: torch's, and the scale :func:`getstate` kept (torch's adds
    ``differentiable`` to the defaults only, as in torch: ``check_param_groups`` lets a group
    lack it)."""
    state = dict(state)
    kept = state.pop(_PICKLED, None)
    torch.optim.Optimizer.__setstate__(optimizer, state)
    if kept is not None:
        loss_scale = kept["loss_scale"]
        restored = LossScale.from_state_dict(loss_scale, loss_scale["scale"].device)
        found_inf = kept["found_inf"]
        pending = None if found_inf is None else GradPass(found_inf)
        optimizer._scaledoptim_scaling = ScalingState(restored, pending=pending)


def adopt_scale(optimizer: Any, loss_scale: LossScale, driver: str) -> None:
    """Makes a GradScaler's ``loss_scale`` the optimizer's scale: ``opt.scale`` is the scaler's
    from now on, and checkpoints carry it. The optimizer's own scale tensor is retired (Note
    [scale handles])."""
    state = optimizer._scaling()
    if state.loss_scale is not loss_scale:
        if state.driver is None:  # (another scaler's scale is that scaler's business)
            state.loss_scale.retire(
                f"This was {type(optimizer).__name__}'s own scale, before a {driver} took it "
                "over: the scaler's scale is the one in use (opt.scale returns it now)"
            )
        state.loss_scale = loss_scale
    state.driver = driver
