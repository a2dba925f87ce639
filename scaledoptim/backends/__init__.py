"""The one seam between the fused optimizers and what runs their update.

A :class:`Backend` turns one param group's tensors into a prepared update (validated before
anything runs); :func:`select` picks the backend for a device, in one place:

* CUDA tensors take our kernels (``cuda/``, launched through CuPy) when CuPy is installed, and
  torch's fused multi-tensor ops otherwise;
* CPU tensors take torch's fused ops, or our kernels through the CPU emulator.

Environment:
    SCALEDOPTIM_KERNELS: ``auto`` (default, the rules above), ``torch`` (torch's fused ops on
        every device), ``cupy`` (our kernels on CUDA even if CuPy looks missing, failing
        loudly then), ``emulate`` (our kernels on every device, CPU tensors through the g++
        emulator: a test and kernel-author tool).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .base import Backend, PreparedUpdate
from .kernels import KERNELS
from .torch_native import TORCH_NATIVE, unscale_in_place_

__all__ = ["Backend", "KERNELS", "PreparedUpdate", "TORCH_NATIVE", "kernels_mode", "select", "unscale_in_place_"]

_MODES = ("auto", "torch", "cupy", "emulate")


def kernels_mode() -> str:
    """The value of ``SCALEDOPTIM_KERNELS`` (``"auto"`` when unset), validated."""
    mode = os.environ.get("SCALEDOPTIM_KERNELS", "auto") or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"Invalid SCALEDOPTIM_KERNELS={mode!r}; use one of {list(_MODES)} (or leave it unset)"
        )
    return mode


def select(device: torch.device) -> Backend:
    """The backend that runs fused updates of tensors on ``device`` (see the module docs)."""
    mode = kernels_mode()
    if mode == "emulate":
        return KERNELS
    if mode != "torch" and device.type == "cuda" and (mode == "cupy" or _cupy_installed()):
        return KERNELS
    return TORCH_NATIVE


@functools.cache
def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None
