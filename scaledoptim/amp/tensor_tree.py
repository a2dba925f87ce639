"""Cast the floating tensors inside (nested) arguments and return values."""

from __future__ import annotations

from typing import Any

import torch


def cast_floating(value: Any, dtype: torch.dtype, device_type: str | None = None) -> Any:
    """Return ``value`` with every floating tensor in it cast to ``dtype``.

    Tensors, lists, tuples (named tuples included) and dicts are traversed; anything else
    is returned as is. float64 tensors are left alone, as autocast leaves them.

    Args:
        value: a tensor or a nested container of tensors.
        dtype: the dtype to cast to.
        device_type: when given, only tensors on this device type are cast.
    """
    if isinstance(value, torch.Tensor):
        eligible = (
            value.is_floating_point()
            and value.dtype is not torch.float64
            and (device_type is None or value.device.type == device_type)
        )
        return value.to(dtype) if eligible else value
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype, device_type) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [cast_floating(item, dtype, device_type) for item in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    return value
