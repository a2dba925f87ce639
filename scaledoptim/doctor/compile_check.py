"""Every kernel compiles with NVRTC: for this GPU, or (without one) for the ends of the range of
architectures we promise, sm_70 and sm_90 (``--all-archs``: every one of them)."""

from __future__ import annotations

import importlib.util

import torch

from ..kernels import builtin_kernels, nvrtc
from .outcome import Outcome

__all__ = ["run"]

_FIX = "install CuPy and NVRTC: pip install scaledoptim[cuda12] (or [cuda13] for CUDA 13 drivers)"

#: Set by ``--all-archs``: compile for every supported target arch, not just the range's ends.
ALL_ARCHS = False


def run(device: torch.device) -> Outcome:
    """Compiles every builtin kernel; fails naming the fix when CuPy or NVRTC is missing."""
    if importlib.util.find_spec("cupy") is None:
        return Outcome(False, f"CuPy is not installed; {_FIX}")
    try:
        supported = nvrtc.supported_archs()
    except Exception as error:  # noqa: BLE001 -- CuPy without a loadable NVRTC library
        return Outcome(False, f"NVRTC cannot be loaded ({type(error).__name__}: {error}); {_FIX}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        archs = (10 * major + minor,)
    elif not supported:
        return Outcome(False, f"this NVRTC supports none of {nvrtc.TARGET_ARCHS}; {_FIX}")
    else:
        archs = supported if ALL_ARCHS else tuple(sorted({supported[0], supported[-1]}))
    for arch in archs:
        for kernel in builtin_kernels():
            try:
                nvrtc.compile_for_arch(kernel, arch)
            except Exception as error:  # noqa: BLE001 -- KernelCompileError carries NVRTC's log
                return Outcome(False, f"{kernel.source.name} for sm_{arch}: {error}")
    names = ", ".join(k.source.name for k in builtin_kernels())
    unsupported = [a for a in nvrtc.TARGET_ARCHS if a not in supported]
    note = f"; this NVRTC cannot target sm_{unsupported}" if unsupported else ""
    return Outcome(True, f"{names} for {', '.join(f'sm_{a}' for a in archs)}{note}")
