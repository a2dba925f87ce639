"""Checks of loss-scale values: what a usable float32 scale is, and user-given scales validated."""

from __future__ import annotations

import math
import struct

import torch

from ..torch_ops import refuse_during_capture

__all__ = ["as_scale_tensor", "is_float32_scale"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def as_scale_tensor(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """Returns ``scale`` as a 0-dim float32 tensor on ``device``, rejecting bad values.

    A Python number is checked on the host for free; a tensor with one host read (the protocol
    takes ``opt.scale`` itself, valid by construction, without calling this: it stays
    sync-free).
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
        refuse_during_capture("Validating a scale tensor other than opt.scale (a host read)")
        as_float32 = scale.detach().reshape(()).to(torch.float32)
        _check_scale_value(as_float32.to("cpu", torch.float64).item())
        return as_float32
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"grads_scaled_by must be a tensor, a float or None, got {type(scale).__name__}"
        )
    rounded = _to_float32(float(scale))
    _check_scale_value(rounded, float(scale))
    return torch.full((), rounded, dtype=torch.float32, device=device)


def _to_float32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range: it would be inf
        return math.inf


def is_float32_scale(value: float) -> bool:
    """Whether ``value``, rounded to float32, is a usable loss scale: finite, > 0 and with a
    finite float32 reciprocal (a scale of 1e300 is inf in float32, one of 1e-300 is 0, and
    1e-45's reciprocal is inf). Roughly ``[1.2e-38, 3.4e38]``: the normal float32 range."""
    as_float32 = _to_float32(float(value))
    return math.isfinite(as_float32) and as_float32 > 0 and 1.0 / as_float32 <= _FLOAT32_MAX


def _check_scale_value(as_float32: float, given: float | None = None) -> None:
    """The scale is used as a float32 and unscaled by its float32 reciprocal: see
    :func:`is_float32_scale`."""
    if not is_float32_scale(as_float32):
        shown = as_float32 if given is None else given
        raise ValueError(
            f"Invalid loss scale {shown}: the scale must be finite and > 0 in float32, and so must "
            "its reciprocal. Use the scale returned by unscale()/unscale_and_step() (or "
            "opt.scale), which always is."
        )
