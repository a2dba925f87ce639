"""Per-param optimizer state of the fused optimizers: validated, created and converted before a
step commits, so a corrupt or foreign state fails cleanly instead of inside a kernel."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..kernels import is_dense

__all__ = [
    "StateLayout",
    "cast_loaded_state",
    "check_param",
    "check_state_layout",
    "stage_state",
    "state_dtype",
]


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a state tensor other than a float one shaped like its param is laid out (a low-bit
    state's codes and scales, Note [block-wise codes] in fused/lowbit/codes.py); an update
    declares them in ``Update.state_layouts``.

    Attributes:
        dtype: its dtype, exactly (it is never converted).
        block_size: ``None``: shaped and strided like its param; else a 1-D tensor of one
            element per block of ``block_size`` of the param's elements in storage order (the
            last block may be partial).
    """

    dtype: torch.dtype
    block_size: int | None = None

    def blocks(self, param: torch.Tensor) -> int:
        """The elements of such a state of ``param`` (per-block layouts)."""
        assert self.block_size is not None
        return -(-param.numel() // self.block_size)

    def zeros(self, param: torch.Tensor) -> torch.Tensor:
        """A new state of ``param``: zeros (a low-bit state of scale 0 reads as zeros)."""
        if self.block_size is None:
            return torch.zeros_like(param, dtype=self.dtype, memory_format=torch.preserve_format)
        return torch.zeros(self.blocks(param), dtype=self.dtype, device=param.device)


def check_state_layout(param: torch.Tensor, key: str, value: Any, layout: StateLayout) -> None:
    """Raises unless ``value`` is a tensor of ``layout`` for ``param`` (its device aside)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Corrupt optimizer state: {key!r} of a param of shape {tuple(param.shape)} is a "
            f"{type(value).__name__}, not a tensor"
        )
    if layout.block_size is None:
        expected, what = tuple(param.shape), "its param's shape"
    else:
        expected = (layout.blocks(param),)
        what = f"one element per block of {layout.block_size} of its param's {param.numel()}"
    if value.dtype != layout.dtype or tuple(value.shape) != expected:
        raise ValueError(
            f"Corrupt optimizer state: {key!r} is a {value.dtype} tensor of shape "
            f"{tuple(value.shape)}, but this optimizer keeps a {layout.dtype} tensor of shape "
            f"{expected} ({what}) for a param of shape {tuple(param.shape)}"
        )
    if layout.block_size is None and value.stride() != param.stride() and value.numel() > 1:
        raise ValueError(
            f"Corrupt optimizer state: {key!r} has strides {value.stride()} but its param "
            f"{param.stride()}; its blocks follow the storage order it was written in, so keep "
            "the param's memory format (or clear that param's state: opt.state[p].clear())"
        )
    if layout.block_size is not None and not value.is_contiguous():
        raise ValueError(f"Corrupt optimizer state: {key!r} must be contiguous")


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """Optimizer state is at least fp32: 16-bit moments underflow (``(1 - beta2) * g**2``).
    A complex param's state is complex, as torch.optim's."""
    return torch.promote_types(param.dtype, torch.float32)


def check_param(param: torch.Tensor) -> None:
    """Rejects params a fused update cannot take, naming what to do instead."""
    if param.layout != torch.strided:
        raise RuntimeError(
            f"A param has layout {param.layout}; scaledoptim's fused optimizers update dense "
            "params only. Use torch.optim's class for sparse params (scaledoptim.with_scaling("
            "torch.optim.X) keeps the loss-scaling protocol)"
        )
    if param.is_complex() or not param.is_floating_point():
        raise TypeError(
            f"A param has dtype {param.dtype}; scaledoptim's fused optimizers update real "
            "floating params (float32, float64, float16, bfloat16) and scaledoptim does not "
            "support complex ones: keep them as real pairs (torch.view_as_real)"
        )
    if not is_dense(param):
        raise RuntimeError(
            f"A param of shape {tuple(param.shape)} and strides {param.stride()} is a view "
            "with gaps or overlaps, which fused optimizers cannot update in place; make the "
            "parameter contiguous (nn.Parameter(t.contiguous()))"
        )


def stage_state(
    param: torch.Tensor,
    state: dict[str, Any],
    keys: Sequence[str | None],
    step_device: torch.device | None = None,
    layouts: Mapping[str, StateLayout] | None = None,
    fill: Mapping[str, float] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, Any] | None]:
    """The param's state tensors for ``keys`` (``None`` keys are skipped) and its step counter,
    a 0-dim float32 tensor on ``step_device`` (default: the param's device). ``layouts``: the
    keys whose tensors are not float ones shaped like the param (:class:`StateLayout`). A float
    state created afresh holds zeros, or ``fill[key]`` (both parts of a complex param's, as
    torch fills them); one of a layout, the layout's zeros.

    Returns ``(tensors, step, replacement)``: ``replacement`` is the whole state dict to install
    when anything had to be created (a first step) or converted (an int or CPU step from an old
    checkpoint, state in another memory layout or dtype than the param), else ``None``. Nothing
    is written to ``state``.

    Raises:
        ValueError, TypeError: a corrupt state entry, naming the param's shape and the fix.
    """
    replacement = dict(state)
    changed = False
    fresh = not any(key != "step" for key in state)
    tensors = []
    for key in keys:
        if key is None:
            continue
        value = state.get(key)
        layout = layouts.get(key) if layouts else None
        if value is None:
            if not fresh:
                raise ValueError(
                    f"Corrupt optimizer state: a param of shape {tuple(param.shape)} has state "
                    f"{sorted(state)} but no {key!r}. Load a state_dict saved by this optimizer "
                    "class with the same options, or clear that param's state "
                    "(opt.state[p].clear()) to restart it"
                )
            start = (fill or {}).get(key, 0.0)
            value = (
                layout.zeros(param)
                if layout is not None
                else torch.full_like(
                    param,
                    complex(start, start) if param.is_complex() else start,
                    dtype=state_dtype(param),
                    memory_format=torch.preserve_format,
                )
            )
        elif layout is not None:
            check_state_layout(param, key, value, layout)
            _check_device(param, key, value)
            tensors.append(value)
            continue
        else:
            _check_state_tensor(param, key, value)
            if value.dtype != state_dtype(param) or value.stride() != param.stride():
                value = torch.empty_like(param, dtype=state_dtype(param)).copy_(value)
            else:
                tensors.append(value)
                continue
        replacement[key], changed = value, True
        tensors.append(value)
    step = state.get("step")
    step_device = param.device if step_device is None else step_device
    if not _is_step_counter(step, step_device):
        replacement["step"], changed = (
            _as_step_counter(param, step, step_device, taken=0.0 if fresh else 1.0),
            True,
        )
    return tensors, replacement["step"], replacement if changed else None


def cast_loaded_state(
    param: torch.Tensor, key: str, value: Any, layout: StateLayout | None = None
) -> Any:
    """A copy of one loaded state entry on the param's device, floating state in
    :func:`state_dtype` (torch's loader would round 16-bit params' moments to 16 bits); one of
    ``layout`` as it is (checked)."""
    if layout is not None:
        check_state_layout(param, key, value, layout)
        return value.to(device=param.device, copy=True)
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(dtype=torch.float32, device=param.device, copy=True)
    if value.is_floating_point():
        _check_state_tensor(param, key, value, loading=True)
        return value.to(dtype=state_dtype(param), device=param.device, copy=True)
    return value.to(device=param.device, copy=True)


def _check_state_tensor(param: torch.Tensor, key: str, value: Any, loading: bool = False) -> None:
    fix = (
        "was it saved for another model?"
        if loading
        else "load a state_dict saved for this model, or clear that param's state "
        "(opt.state[p].clear()) to restart it"
    )
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Corrupt optimizer state: {key!r} of a param of shape {tuple(param.shape)} is a "
            f"{type(value).__name__}, not a tensor; {fix}"
        )
    if value.shape != param.shape or not (
        value.is_complex() == param.is_complex()
        and (value.is_floating_point() or value.is_complex())
    ):
        kind = "complex" if param.is_complex() else "real floating"
        raise ValueError(
            f"Corrupt optimizer state_dict: state {key!r} is a {value.dtype} tensor of shape "
            f"{tuple(value.shape)} but its param is a {kind} tensor of shape "
            f"{tuple(param.shape)}; {fix}"
        )
    if not loading:
        _check_device(param, key, value)


def _check_device(param: torch.Tensor, key: str, value: torch.Tensor) -> None:
    if value.device != param.device:
        raise RuntimeError(
            f"Optimizer state {key!r} is on {value.device} but its param is on {param.device}; "
            "move the state with the param (opt.load_state_dict(opt.state_dict()) after "
            "model.to(device) does it)"
        )


def _is_step_counter(step: Any, device: torch.device) -> bool:
    return (
        isinstance(step, torch.Tensor)
        and step.dtype == torch.float32
        and step.shape == ()
        and step.device == device
    )


def _as_step_counter(
    param: torch.Tensor, step: Any, device: torch.device, taken: float
) -> torch.Tensor:
    """A 0-dim float32 counter on ``device``. A state without one (torch.optim.SGD's) has
    ``taken`` steps; an old checkpoint's int step, or a counter elsewhere, is converted."""
    if step is None:
        return torch.full((), taken, dtype=torch.float32, device=device)
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        return step.detach().reshape(()).to(dtype=torch.float32, device=device, copy=True)
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return torch.full((), float(step), dtype=torch.float32, device=device)
    raise TypeError(
        f"Corrupt optimizer state: 'step' of a param of shape {tuple(param.shape)} is "
        f"{step!r}; it must be a number or a one-element tensor. Load a state_dict saved by "
        "this optimizer, or clear that param's state (opt.state[p].clear()) to restart it"
    )
