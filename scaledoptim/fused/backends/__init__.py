"""The one seam between the fused optimizers and what runs their update.

A :class:`Backend` turns one param group's tensors into a prepared update (validated before
anything runs); :func:`select` picks the backend for a device, in one place:

* CUDA tensors take our kernels (``cuda/``, launched through CuPy) when the install has what
  they need for that device, and torch's fused multi-tensor ops when it lacks a piece (no CuPy,
  no NVRTC, an arch the installed NVRTC cannot target, a driver older than CuPy's CUDA), with
  one warning naming it and the fix; a probe launch that fails anyway raises (Note [kernel
  probe] in ``probe.py``);
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

import os
import warnings

import torch

from ...kernels.cuda_backend import unmet_requirement
from .base import Backend, PreparedEpilogue, PreparedReduction, PreparedUnscale, PreparedUpdate
from .kernels import KERNELS
from .probe import KernelProbeError, probe_kernels
from .torch_native import TORCH_NATIVE
from .torch_optim import TORCH_OPTIM, step_device, torch_optim_indices

__all__ = [
    "KERNELS", "KERNELS_ENV", "TORCH_NATIVE", "TORCH_OPTIM", "Backend", "KernelProbeError",
    "PreparedEpilogue", "PreparedReduction", "PreparedUnscale", "PreparedUpdate", "kernels_mode",
    "select", "step_device", "torch_optim_indices",
]

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

    The first call for a CUDA device in ``auto`` mode reads the install and, when it has what
    the kernels need, compiles and runs a probe launch there and waits for it (one host sync,
    once per device per process; Note [kernel probe]).

    Raises:
        KernelProbeError: when the install has what the kernels need but the probe fails.
    """
    mode = kernels_mode()
    if mode == "emulate" or (mode == "cupy" and device.type == "cuda"):
        return KERNELS
    if mode == "torch" or device.type != "cuda":
        return TORCH_NATIVE
    if device in _probed:
        return KERNELS
    if device not in _absent:
        _absent[device] = unmet_requirement(device)
    missing = _absent[device]
    if missing is not None:
        if device not in _warned:
            _warned.add(device)
            warnings.warn(
                f"scaledoptim's CUDA kernels cannot run on {device}: {missing}. Until then the "
                "fused optimizers use torch's fused ops there (also sync-free, but grads are "
                "unscaled in place); SCALEDOPTIM_KERNELS=torch silences this, "
                "SCALEDOPTIM_KERNELS=cupy turns it into an error.",
                RuntimeWarning,
                stacklevel=3,
            )
        return TORCH_NATIVE
    probe_kernels(device)  # raises, and is not kept: the next step probes again
    _probed.add(device)
    return KERNELS


#: Devices whose probe passed; what each device's install lacks (``None``: nothing); devices
#: warned about (Note [kernel probe]).
_probed: set[torch.device] = set()
_absent: dict[torch.device, str | None] = {}
_warned: set[torch.device] = set()
