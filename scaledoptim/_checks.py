"""Validation of user input shared by the protocol methods; every check runs before anything changes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def as_scale_tensor(
    scale: torch.Tensor | float, device: torch.device, *, trusted: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns ``scale`` as a 0-dim float32 tensor on ``device``, rejecting bad values.

    A Python number is checked on the host for free. The optimizer's own scale tensor
    (``trusted``) is valid by construction and is not read. Any other tensor is validated with
    one host read, so pass ``opt.scale`` itself to stay sync-free.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise TypeError(
                f"grads_scaled_by must be a one-element floating tensor or a float, got a "
                f"{scale.dtype} tensor of shape {tuple(scale.shape)}; pass opt.scale"
            )
        if scale.device != device:
            raise RuntimeError(
                f"grads_scaled_by is on {scale.device} but the optimizer's grads are on {device}; "
                f"pass opt.scale (it lives on {device}) or move the scale there"
            )
        if scale is trusted:
            return scale
        _check_scale_value(scale.detach().to("cpu", torch.float64).item())
        return scale.detach().reshape(()).to(torch.float32)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"grads_scaled_by must be a tensor, a float or None, got {type(scale).__name__}"
        )
    _check_scale_value(float(scale))
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def _check_scale_value(value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"Invalid loss scale {value}: the scale must be finite and > 0. Use the scale "
            "returned by unscale()/unscale_and_step() (or opt.scale), which always is."
        )


def check_grads(grads: Iterable[torch.Tensor], device: torch.device) -> None:
    """Rejects sparse grads and grads off ``device`` before anything is modified."""
    for grad in grads:
        if grad.is_sparse:
            raise RuntimeError(
                "scaledoptim does not support sparse gradients; use a dense layer (e.g. "
                "nn.Embedding(sparse=False)) or a torch.optim sparse optimizer without scaling"
            )
        if grad.device != device:
            raise RuntimeError(
                f"A grad is on {grad.device} but the loss scale is on {device}; an optimizer's "
                "params must all live on one device: use one optimizer per device"
            )
