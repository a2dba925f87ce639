"""Scaling what backward starts from: outputs, or the gradients fed to them; and the check that
a step unscales by the scale its grads' backward was scaled by.

Note [the scale a backward was scaled by]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``scale_outputs(loss, S)`` with an optimizer's scale tensor ``S`` records, on ``S`` (Note [scale
handles] in scale/loss_scale.py), that a backward is being scaled by it (``"scaled"``, cleared
when the scale moves for that backward). The optimizer's ``unscale()``/``unscale_and_step()`` then
check ``grads_scaled_by`` against the record, before anything changes:

* After a backward scaled by ``S``, ``grads_scaled_by`` must be ``S`` itself, or hold its
  value. ``None`` would step on scaled grads. The record is the tensor (its identity: ``S`` moves
  only when the scale moves for that backward, or a load or ``configure_scaling`` writes it, and
  each of those clears ``"scaled"``), so ``S`` itself is always right and costs nothing. A
  Python number or another tensor is compared by value where reading both is free (a CPU
  scale); elsewhere it is refused, whatever its value: comparing would read ``S`` on the host, a
  sync on a GPU.
* The reverse mistake, ``grads_scaled_by=S`` after a backward that was not scaled, is not
  refused: a backward scaled by hand, ``(loss * S).backward()``, looks the same to the library,
  and so do grads left by a closure step (already unscaled) that a later ``unscale`` is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..scale import handle_state

__all__ = ["backward", "check_grads_scaled_by", "first_tensor", "grad", "scale_outputs"]

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
    if handle is not None:  # See Note [scale handles]: a write torch.compile replays, no guard
        handle["scaled"] = True
    return scaled


def check_grads_scaled_by(
    grads_scaled_by: torch.Tensor | float,
    scale: torch.Tensor,
    scaled: bool,
) -> None:
    """Refuses a ``grads_scaled_by`` that is not the scale of the backward that made the grads
    (Note [the scale a backward was scaled by]). No host sync. Called once the value passed its
    own validation (finite, positive), so a bad value is refused as such first; ``None`` is
    checked before (``Optimizer._check_told_unscaled``).

    Args:
        grads_scaled_by: what the user says the grads were scaled by.
        scale: the optimizer's scale tensor (``opt.scale``).
        scaled: whether a backward was scaled by ``scale`` that the optimizer has not unscaled.

    Raises:
        RuntimeError: naming both scales and the fix.
    """
    if scaled:
        if grads_scaled_by is not scale and not _equal_on_host(grads_scaled_by, scale):
            raise RuntimeError(
                f"grads_scaled_by={_described(grads_scaled_by)}, but the grads come from a "
                f"backward scaled by opt.scale{_value(scale)} "
                "(scaledoptim.scale_outputs(loss, opt.scale)): pass grads_scaled_by=opt.scale, "
                "the tensor the loss was scaled by. Off the CPU a number or another tensor is "
                "refused even when it holds the same value: comparing them would read the scale "
                "on the host."
            )


def _equal_on_host(value: torch.Tensor | float, scale: torch.Tensor) -> bool:
    """Whether ``value`` equals ``scale``, where both can be read for free (on the CPU);
    ``False`` where telling would sync."""
    if scale.device.type != "cpu":
        return False
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            return False
        value = value.item()
    return float(value) == scale.item()


def _described(value: torch.Tensor | float) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor that is not opt.scale{_value(value)}"
    return repr(value)


def _value(tensor: torch.Tensor) -> str:
    """`` (= value)`` where reading it is free (a CPU tensor), else where it lives."""
    if tensor.device.type == "cpu" and tensor.numel() == 1:
        return f" (= {tensor.item():g})"
    return f" (on {tensor.device}; not read, which would sync)"


def first_tensor(outputs: Any) -> torch.Tensor | None:
    """The first tensor of a nested list/tuple/dict, ``None`` if none (a GradScaler's
    ``scale()`` creates its scale on that tensor's device, as torch's does)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        outputs = list(outputs.values())
    if isinstance(outputs, (list, tuple)):
        for value in outputs:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


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
