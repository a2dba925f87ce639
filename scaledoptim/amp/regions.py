"""Which autocast regions on this thread are scaledoptim's.

Note [telling regions apart]: torch keeps autocast state per thread in C++ (enabled flag
and dtype per device, one nesting counter). scaledoptim's kernels also run inside plain
``torch.autocast`` regions, where they must behave like torch's default policy. Each
scaledoptim region records the nesting level torch reached when it was entered; a kernel
is inside a scaledoptim region exactly when the innermost scaledoptim region of its device
is at the current nesting level, i.e. no other autocast region was entered inside it.
"""

from __future__ import annotations

import threading

import torch

from .cache import thread_cache

_local = threading.local()


def _levels() -> dict[str, list[int]]:
    try:
        return _local.levels
    except AttributeError:
        _local.levels = {}
        return _local.levels


def current_nesting() -> int:
    """Return torch's autocast nesting level on this thread, leaving it unchanged."""
    torch.autocast_increment_nesting()
    return torch.autocast_decrement_nesting()


def enter_region(device_type: str) -> None:
    """Record that a scaledoptim region for ``device_type`` was just entered."""
    levels = _levels()
    if not any(levels.values()):
        thread_cache().reset()
    levels.setdefault(device_type, []).append(current_nesting())


def exit_region(device_type: str) -> None:
    """Record that the innermost scaledoptim region for ``device_type`` is being exited."""
    levels = _levels()
    levels[device_type].pop()
    if not any(levels.values()):
        thread_cache().clear()


def in_scaledoptim_region(device_type: str) -> bool:
    """Return True when the innermost autocast region for ``device_type`` is scaledoptim's."""
    levels = _levels().get(device_type)
    return bool(levels) and levels[-1] == current_nesting()
