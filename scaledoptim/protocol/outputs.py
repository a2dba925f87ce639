"""Scaling what backward starts from: outputs, or the gradients fed to them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..scale import handle_state

__all__ = ["backward", "grad", "scale_outputs"]

_T = TypeVar("_T")


def scale_outputs(outputs: _T, scale: torch.Tensor | float | None) -> _T:
    r"""Multiplies a tensor, or every tensor in a nested list/tuple/dict, by ``scale``.

    ``None`` entries pass through, and ``scale=None`` returns ``outputs`` unchanged, so one
    training loop serves scaled (fp16) and unscaled (bf16/fp32) runs. Like
    :meth:`torch.amp.GradScaler.scale`, a 0-dim ``scale`` does not change an output's dtype.

    Scaling by an optimizer's :attr:`~scaledoptim.Optimizer.scale` also tells the optimizer that
    its grads will be scaled: a plain ``opt.step()`` after the backward then unscales (and skips
    on overflow) as ``opt.unscale_and_step(grads_scaled_by=opt.scale)`` would, instead of
    stepping on scaled grads. A scale tensor that is no longer any optimizer's scale (another
    optimizer's before :func:`~scaledoptim.share_scale`, say) is refused.

    Example::

        >>> scaledoptim.scale_outputs(loss, opt.scale).backward()
        >>> torch.autograd.backward(scaledoptim.scale_outputs((out0, out1), S))
    """
    handle = handle_state(scale) if isinstance(scale, torch.Tensor) else None
    if handle is not None and handle["retired"] is not None:
        # Scaled by a stale handle, the backward could not be told to the optimizer whose
        # grads it makes (Note [scale handles]): refuse it at its first use.
        raise RuntimeError(f"This scale tensor is no longer in use. {handle['retired']}")
    scaled = _scaled(outputs, scale)
    if handle is not None:  # Note [scale handles]: a write torch.compile replays, no guard
        handle["scaled"] = True
    return scaled


def _scaled(outputs: _T, scale: torch.Tensor | float | None) -> _T:
    """``outputs`` times ``scale`` (see :func:`scale_outputs`), telling no optimizer."""
    if scale is None:
        return outputs
    moved: dict[torch.device, torch.Tensor] = {}

    def scaled(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            if not isinstance(scale, torch.Tensor):
                return value * scale
            if value.device not in moved:
                moved[value.device] = scale.to(device=value.device, non_blocking=True)
            return value * moved[value.device]
        container: Any = type(value)  # rebuilt as the user's own container type
        if isinstance(value, Mapping):
            return container((k, scaled(v)) for k, v in value.items())
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            items = [scaled(v) for v in value]
            return container(*items) if hasattr(value, "_fields") else container(items)
        raise TypeError(
            f"scale_outputs() takes tensors, None, and lists/tuples/dicts of them; got "
            f"{type(value).__name__}"
        )

    return scaled(outputs)


def backward(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    grad_tensors: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    scale_grads_by: torch.Tensor | float | None = None,
) -> None:
    r""":func:`torch.autograd.backward` with ``scale_grads_by``: the grads it accumulates are
    multiplied by that scale (by scaling ``grad_tensors`` if given, else ``tensors``).

    Example::

        >>> scaledoptim.backward(loss, scale_grads_by=opt.scale)
    """
    if grad_tensors is None:
        tensors = scale_outputs(tensors, scale_grads_by)
    else:
        grad_tensors = scale_outputs(grad_tensors, scale_grads_by)
    torch.autograd.backward(
        tensors, grad_tensors, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs
    )


def grad(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    *,
    scale_grads_by: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor | None, ...]:
    r""":func:`torch.autograd.grad` with ``scale_grads_by``: the returned grads are scaled.

    Divide them by the scale before using their values (a gradient penalty, for instance):
    they are *scaled* so that fp16 backward does not underflow.

    Example::

        >>> grads = scaledoptim.grad(loss, params, create_graph=True, scale_grads_by=S)
        >>> penalty = sum((g / S).pow(2).sum() for g in grads)
    """
    # The grads it returns are not the optimizer's: its next step is not told they are scaled.
    if grad_outputs is None:
        outputs = _scaled(outputs, scale_grads_by)
    else:
        grad_outputs = _scaled(grad_outputs, scale_grads_by)
    return torch.autograd.grad(
        outputs,
        inputs,
        grad_outputs,
        retain_graph=retain_graph,
        create_graph=create_graph,
        allow_unused=allow_unused,
    )
