"""``scaledoptim.GradScaler.step(opt, max_grad_norm=c)``: the clip a GradScaler script writes as
``unscale_`` + ``clip_grad_norm_`` + ``step``, taken into the step (Note [clipping in the step]
in clipping.py). The facade's step builds the request; this module holds what it checks and the
three calls it stands for on an optimizer without the protocol."""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["check_no_unscale_before_clip", "step_clipping_torch_optimizer"]


def check_no_unscale_before_clip(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> None:
    """Refuses ``step(opt, max_grad_norm=c)`` after ``unscale_(opt)`` in the same iteration."""
    # A disabled scaler has no per-optimizer states: it never unscales.
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    if state is not None and state["stage"] is OptState.UNSCALED:
        raise RuntimeError(
            "scaler.step(opt, max_grad_norm=...) clips inside the step, but scaler.unscale_(opt) "
            "was called this iteration and the grads are unscaled already. Either drop "
            "unscale_() (the step unscales and clips in one), or clip them yourself after "
            "unscale_() (torch.nn.utils.clip_grad_norm_) and call scaler.step(opt)."
        )


def step_clipping_torch_optimizer(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``scaler.step(opt, max_grad_norm=c)`` for an optimizer without the protocol: the three
    calls it stands for, ``unscale_`` (when the scaler is enabled), ``clip_grad_norm_`` and
    ``step``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    return scaler.step(optimizer, *args, **kwargs)
