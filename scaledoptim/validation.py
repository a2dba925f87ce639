"""Validation of user input for the protocol methods' plans; every check runs before anything changes."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import torch

_FLOAT32_MAX = torch.finfo(torch.float32).max


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_during_capture(what: str) -> None:
    """Raises if a CUDA graph is being captured: ``what`` would be recorded once and replayed
    wrong, or would sync."""
    if capturing():
        raise RuntimeError(
            f"{what} cannot happen inside CUDA graph capture. Take one eager step first (it "
            "creates the optimizer state and compiles the kernels), pass opt.scale (or a Python "
            "float) as the scale, then capture."
        )


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
        refuse_during_capture("Validating a scale tensor other than opt.scale (a host read)")
        as_float32 = scale.detach().reshape(()).to(torch.float32)
        _check_scale_value(as_float32.to("cpu", torch.float64).item())
        return as_float32
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"grads_scaled_by must be a tensor, a float or None, got {type(scale).__name__}"
        )
    as_float32 = _to_float32(float(scale))
    _check_scale_value(as_float32, float(scale))
    return torch.full((), as_float32, dtype=torch.float32, device=device)


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


def hyperparameter(name: str, value: object) -> object:
    """A hyper-parameter as the update reads it: a Python number, or a one-element CPU tensor's
    current value (torch.optim accepts tensor ``lr`` and ``betas``; a scheduler updates the tensor
    in place, and reading a CPU tensor costs no device sync). Anything else is returned as is.

    Raises:
        ValueError: a tensor with more than one element (torch's message).
        TypeError: a tensor on another device than the CPU: our kernels take hyper-parameters
            by value at launch, so reading it would sync the device on every step.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element")
    if value.device.type != "cpu":
        raise TypeError(
            f"{name} is a tensor on {value.device}; scaledoptim's fused optimizers read "
            "hyper-parameters on the host at each step, which would sync the device every step. "
            f"Pass a float or a CPU tensor ({name}=torch.tensor(x)); schedulers update either."
        )
    return value.item()


def check_param_grads(params: Iterable[torch.Tensor], device: torch.device) -> None:
    """Rejects, before anything is modified, grads that are not floating, sparse, off
    ``device``, or not shaped like their param. One pass: it runs on every step."""
    for param in params:
        grad = param.grad
        if grad.is_complex() or param.is_complex():
            raise TypeError(
                f"A param or grad has dtype {grad.dtype}: scaledoptim does not support complex "
                "params. Keep them as real pairs (torch.view_as_real) or give them an optimizer "
                "of their own without scaling"
            )
        if not grad.is_floating_point():
            raise TypeError(
                f"A grad has dtype {grad.dtype}; grads must be floating point. Assign p.grad a "
                "floating tensor (autograd always produces one)."
            )
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
        if grad.shape != param.shape:
            raise ValueError(
                f"A grad has shape {tuple(grad.shape)} but its param has shape "
                f"{tuple(param.shape)}; a grad assigned through .data bypassed autograd's check. "
                "Assign p.grad a tensor shaped like p."
            )


def check_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """Rejects a param group that lost an option its optimizer's defaults have (torch would raise
    a bare ``KeyError`` mid-step)."""
    for index, group in enumerate(optimizer.param_groups):
        missing = sorted(key for key in optimizer.defaults if key not in group)
        if missing:
            raise ValueError(
                f"param_groups[{index}] has no {missing}: every param group must hold all of "
                f"{type(optimizer).__name__}'s options. Add groups with opt.add_param_group(...) "
                "(it fills in the defaults), or restore the key, e.g. "
                f"opt.param_groups[{index}][{missing[0]!r}] = opt.defaults[{missing[0]!r}]"
            )
