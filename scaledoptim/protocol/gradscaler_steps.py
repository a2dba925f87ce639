"""What ``scaledoptim.GradScaler`` runs for a scaledoptim optimizer (Note [GradScaler facade] in
gradscaler.py): torch's stage checks, the checks before the optimizer's scale becomes the
scaler's, then the protocol's stages (``steps.py``) under the scaler's scale, which they never
move (``update()`` does)."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.amp.grad_scaler import OptState

from ..scale import LossScale
from . import split_form, steps
from .optimizer import Optimizer
from .user_frames import user_stacklevel
from .values import Request

__all__ = ["check_stage", "has_grads", "step_request", "unscale"]

_DRIVER = "scaledoptim.GradScaler"


def check_stage(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, method: str
) -> OptState:
    """The optimizer's stage this iteration, refusing what torch refuses (same messages)."""
    state = scaler._per_optimizer_states.get(id(optimizer))
    stage = OptState.READY if state is None else state["stage"]
    if method == "unscale_" and stage is OptState.UNSCALED:
        raise RuntimeError(
            "unscale_() has already been called on this optimizer since the last update()."
        )
    if method == "unscale_" and stage is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    if method == "step" and stage is OptState.STEPPED:
        raise RuntimeError("step() has already been called since the last update().")
    return stage


def unscale(
    scaler: torch.amp.GradScaler, optimizer: Optimizer, loss_scale: LossScale, touched: bool
) -> torch.Tensor | None:
    """``scaler.unscale_(optimizer)``: the grads unscaled in place by the scaler's scale, which
    does not move, and the scaler's ``loss_scale`` taken as the optimizer's. Returns the agreed
    ``found_inf``, ``None`` when no param has a grad."""
    _check_can_adopt(scaler, optimizer, loss_scale, touched)
    plan = steps.plan(optimizer)
    if not plan.grads:
        return None
    assert scaler._scale is not None  # torch's _check_scale_growth_tracker checked it
    device = optimizer.scaling_state.loss_scale.device
    scale = scaler._scale.to(device, torch.float32, non_blocking=True)
    request = Request(scale, moves_scale=False, adopt=(loss_scale, _DRIVER))
    return split_form.unscale(optimizer, request, plan).found_inf


def step_request(
    scaler: torch.amp.GradScaler,
    optimizer: Optimizer,
    loss_scale: LossScale,
    touched: bool,
    max_grad_norm: float | None,
) -> Request:
    """``scaler.step(optimizer)``'s request on scaled grads: check and unscale them by the
    scaler's scale (clipping to ``max_grad_norm``) without moving it, and take the scaler's
    ``loss_scale`` as the optimizer's."""
    _check_can_adopt(scaler, optimizer, loss_scale, touched)
    return dataclasses.replace(
        steps.validate_request(optimizer, optimizer.scaling_state, None, max_grad_norm),
        scaled_by=scaler._scale,
        moves_scale=False,
        adopt=(loss_scale, _DRIVER),
    )


def has_grads(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _check_can_adopt(
    scaler: torch.amp.GradScaler, optimizer: Optimizer, loss_scale: LossScale, touched: bool
) -> None:
    """Refuses, before anything changes, an optimizer whose scale cannot become the scaler's
    ``loss_scale``; warns when adopting it drops a scale the optimizer loaded from a checkpoint
    while the scaler's own state was never loaded nor moved (``touched``)."""
    state = optimizer.scaling_state
    if state.loss_scale is loss_scale:
        return
    name = type(optimizer).__name__
    if state.loss_scale.sharers > 1:
        raise RuntimeError(
            f"{name} shares its scale with other optimizers (scaledoptim.share_scale): a "
            "GradScaler shares its own scale among every optimizer it steps, so step "
            "optimizers that were never given to share_scale()"
        )
    if state.unscaled:
        raise RuntimeError(
            f"{name}.unscale() was called this iteration: a GradScaler unscales itself. Use "
            "scaler.unscale_(opt) instead, or the optimizer's own protocol throughout"
        )
    device = optimizer._params_device()
    if device != loss_scale.device:
        raise RuntimeError(
            f"This GradScaler's scale lives on {loss_scale.device} (where scaler.scale() "
            f"first met a tensor), but {name}'s params are on {device}: a scaledoptim "
            "optimizer takes the scaler's scale as its own, so scale outputs on its device"
        )
    if state.loaded and not touched:
        warnings.warn(
            f"scaledoptim.GradScaler takes over {name}'s scale, which was loaded from a "
            "checkpoint, but the scaler's own state was never loaded: the run continues "
            f"from the scaler's scale ({scaler._init_scale:g}), not the checkpoint's. Load "
            "the scaler's state_dict too (scaler.load_state_dict(...)), as with "
            "torch.amp.GradScaler.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
