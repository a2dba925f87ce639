"""The one seam between the fused optimizers and what runs their update.

A :class:`Backend` turns one param group's tensors into a prepared update (validated before
anything runs); :func:`select` picks the backend for a device, in one place:

* CUDA tensors take our kernels (``cuda/``, launched through CuPy) when CuPy is installed and
  the kernels compile and run on that device, and torch's fused multi-tensor ops otherwise
  (when CuPy is there but the kernels fail -- no NVRTC, an unsupported arch, a CuPy/driver
  mismatch -- with one warning naming the reason and the fix);
* CPU tensors take torch's fused ops, or our kernels through the CPU emulator;
* what neither can update (complex params, sparse grads, views with gaps, ``differentiable=True``)
  takes torch.optim's own implementation (``torch_optim.py``, Note [torch.optim route]).

Environment:
    SCALEDOPTIM_KERNELS: ``auto`` (default, the rules above), ``torch`` (torch's fused ops on
        every device), ``cupy`` (our kernels on CUDA, and errors instead of a fallback),
        ``emulate`` (our kernels on every device, CPU tensors through the g++ emulator: a test
        and kernel-author tool).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from ...kernels import non_finite_check_
from .base import Backend, PreparedEpilogue, PreparedReduction, PreparedUnscale, PreparedUpdate
from .kernels import KERNELS
from .torch_native import TORCH_NATIVE
from .torch_optim import TORCH_OPTIM, step_device, torch_optim_indices

__all__ = [
    "KERNELS", "KERNELS_ENV", "TORCH_NATIVE", "TORCH_OPTIM", "Backend", "PreparedEpilogue",
    "PreparedReduction", "PreparedUnscale", "PreparedUpdate", "kernel_problem", "kernels_mode",
    "select", "step_device", "torch_optim_indices",
]  # fmt: skip

#: The environment variable that picks the backends (see the module docs).
KERNELS_ENV = "SCALEDOPTIM_KERNELS"
_MODES = ("auto", "torch", "cupy", "emulate")


def kernels_mode() -> str:
    """The value of ``SCALEDOPTIM_KERNELS`` (``"auto"`` when unset), validated."""
    mode = os.environ.get(KERNELS_ENV, "auto") or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"Invalid SCALEDOPTIM_KERNELS={mode!r}; use one of {list(_MODES)} (or leave it unset)"
        )
    return mode


def select(device: torch.device) -> Backend:
    """The backend that runs fused updates of tensors on ``device`` (see the module docs).

    The first call for a CUDA device in ``auto`` mode compiles and runs a one-element probe
    launch there and waits for it (one host sync, once per device per process).
    """
    mode = kernels_mode()
    if mode == "emulate" or (mode == "cupy" and device.type == "cuda"):
        return KERNELS
    if mode == "torch" or device.type != "cuda" or not _cupy_installed():
        return TORCH_NATIVE
    problem = kernel_problem(device)
    if problem is None:
        return KERNELS
    if device not in _warned:
        _warned.add(device)
        warnings.warn(
            f"scaledoptim's CUDA kernels cannot run on {device} ({problem}); the fused "
            "optimizers use torch's fused ops there instead (also sync-free, but grads are "
            "unscaled in place). To fix it, install the CuPy build for your driver, the cuda12 "
            'or cuda13 extra (pip install -e ".[cuda12]" in a checkout, pip install '
            '"scaledoptim[cuda12]" with a wheel); SCALEDOPTIM_KERNELS=torch silences this, '
            "SCALEDOPTIM_KERNELS=cupy turns it into an error.",
            RuntimeWarning,
            stacklevel=3,
        )
    return TORCH_NATIVE


_warned: set[torch.device] = set()


@functools.cache
def kernel_problem(device: torch.device) -> str | None:
    """Why our kernels cannot run on ``device`` (a probe compiles and launches the inf/nan check
    on a tensor there and reads the result), or ``None`` when they can."""
    try:
        probe = torch.tensor([0.0, float("nan")], device=device)
        found_inf = torch.zeros((), device=device)
        non_finite_check_([probe], found_inf)
        seen = found_inf.item()
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if seen != 1.0:
        return f"the probe launch computed found_inf={seen} instead of 1.0"
    return None


@functools.cache
def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None
