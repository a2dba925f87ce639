"""Self-cleaning regions: fp32 functions, and autocast-aware autograd Functions."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import policies
from .context import autocast
from .regions import in_scaledoptim_region
from .tensor_tree import cast_floating

F = TypeVar("F", bound=Callable[..., Any])


def float32(func: F) -> F:
    """Run ``func`` with autocast disabled and its floating inputs cast to float32.

    Use it for code that must run in full precision inside an autocast region: low precision
    tensors coming from the region are cast up,
    and no op inside is autocast, on any device type.

    Example::

        >>> import torch, scaledoptim.amp as amp
        >>> @amp.float32
        ... def stable_norm(x):
        ...     return x.pow(2).sum().sqrt()
        >>> with amp.autocast("cpu", dtype=torch.bfloat16):
        ...     stable_norm(torch.randn(8, dtype=torch.bfloat16)).dtype
        torch.float32
    """

    @functools.wraps(func)
    def float32_wrapper(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for device_type in policies.AUTOCAST_DISPATCH_KEYS:
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(autocast(device_type, enabled=False))
            return func(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))

    return float32_wrapper  # type: ignore[return-value]


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str,
    cast_inputs: torch.dtype | None = None,
) -> Any:
    """Decorate the ``forward`` of a :class:`torch.autograd.Function` for autocast.

    Like :func:`torch.amp.custom_fwd`, and aware of scaledoptim regions: the backward
    decorated with :func:`custom_bwd` runs in the same kind of region as the forward (a
    scaledoptim region with the edited policies, or a plain torch one) with its dtype.

    Args:
        fwd: the ``forward`` staticmethod (the decorator may be used with or without
            arguments).
        device_type: ``"cpu"`` or ``"cuda"``.
        cast_inputs: when given and autocast is enabled, ``forward`` runs with autocast
            disabled and its floating inputs on ``device_type`` cast to this dtype;
            when ``None``, ``forward`` runs in the surrounding region unchanged.
    """
    if device_type not in policies.AUTOCAST_DISPATCH_KEYS:
        raise ValueError(
            f"Unsupported device_type {device_type!r}: expected one of "
            f"{sorted(policies.AUTOCAST_DISPATCH_KEYS)}"
        )
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def custom_fwd_wrapper(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        autocasting = torch.is_autocast_enabled(device_type)
        ctx._scaledoptim_autocast = {
            "dtype": torch.get_autocast_dtype(device_type),
            "enabled": autocasting and cast_inputs is None,
            "scaledoptim_region": in_scaledoptim_region(device_type),
        }
        if cast_inputs is None or not autocasting:
            return fwd(ctx, *args, **kwargs)
        with autocast(device_type, enabled=False):
            return fwd(
                ctx,
                *cast_floating(args, cast_inputs, device_type),
                **cast_floating(kwargs, cast_inputs, device_type),
            )

    return custom_fwd_wrapper


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Any:
    """Decorate the ``backward`` of a :class:`torch.autograd.Function` for autocast.

    ``backward`` runs with the autocast state its ``forward`` (decorated with
    :func:`custom_fwd`) ran with: enabled or not, the same dtype, and a scaledoptim region
    when the forward ran in one. Backward may run on another thread, where the forward's
    region is not active, hence the re-entry.

    Args:
        bwd: the ``backward`` staticmethod.
        device_type: ``"cpu"`` or ``"cuda"``; must match ``custom_fwd``.
    """
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def custom_bwd_wrapper(ctx: Any, *grads: Any) -> Any:
        state = getattr(ctx, "_scaledoptim_autocast", None)
        if state is None:
            raise RuntimeError(
                "custom_bwd found no autocast state on ctx: decorate the Function's forward "
                "with scaledoptim.amp.custom_fwd as well"
            )
        region = autocast if state["scaledoptim_region"] else torch.autocast
        with region(device_type, dtype=state["dtype"], enabled=state["enabled"]):
            return bwd(ctx, *grads)

    return custom_bwd_wrapper
