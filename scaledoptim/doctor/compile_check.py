"""Every kernel compiles with NVRTC: for this GPU, or (without one) for the oldest and the newest
target architecture the installed NVRTC supports (CUDA 12.9's: sm_70 and sm_121; CUDA 13's: sm_75
and sm_121), ``--all-archs``: every one of them. The detail names the targets this NVRTC cannot
compile for (Note [target archs] in kernels/nvrtc.py).

Without CuPy the check is skipped, not failed: nothing needs it there. CPU training runs torch's
fused ops, and on a GPU the fused optimizers fall back to torch's fused ops (sync-free too). The
detail says so and how to install the kernels' dependencies."""

from __future__ import annotations

import importlib.util

import torch

from ..kernels import builtin_kernels, nvrtc
from .outcome import Outcome

__all__ = ["run"]

_FIX = (
    'install CuPy and NVRTC, the cuda12 extra: pip install -e ".[cuda12]" in a checkout, or '
    'pip install "scaledoptim[cuda12]" where scaledoptim was installed from a wheel ([cuda13] '
    "for CUDA 13 drivers)"
)

#: Set by ``--all-archs``: compile for every supported target arch, not just the range's ends.
ALL_ARCHS = False


def run(device: torch.device) -> Outcome:
    """Compiles every builtin kernel; skipped without CuPy, and fails naming the fix when NVRTC
    is missing or a kernel does not compile."""
    if importlib.util.find_spec("cupy") is None:
        return Outcome.skip(_without_cupy(device))
    try:
        installed = nvrtc.installed_archs()
    except Exception as error:
        return Outcome(False, f"NVRTC cannot be loaded ({type(error).__name__}: {error}); {_FIX}")
    supported = nvrtc.supported_archs()
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        archs: tuple[int, ...] = (10 * major + minor,)
        if archs[0] not in installed:
            return Outcome(
                False,
                f"this NVRTC cannot compile for sm_{archs[0]} of {device} (it targets "
                f"{_names(installed)}); the fused optimizers use torch's fused ops there. For the "
                f"kernels, {_FIX} (the cuda12 extra for sm_70/sm_72: CUDA 13 dropped them)",
            )
    elif not supported:
        return Outcome(False, f"this NVRTC supports none of {_names(nvrtc.TARGET_ARCHS)}; {_FIX}")
    else:
        archs = supported if ALL_ARCHS else tuple(sorted({supported[0], supported[-1]}))
    for arch in archs:
        for kernel in builtin_kernels():
            try:
                nvrtc.compile_for_arch(kernel, arch)
            except Exception as error:
                return Outcome(False, f"{kernel.source.name} for sm_{arch}: {error}")
    # One entry per source: a file with several kernels (lamb.cu) compiled them all.
    names = ", ".join(dict.fromkeys(k.source.name for k in builtin_kernels()))
    unsupported = [a for a in nvrtc.TARGET_ARCHS if a not in supported]
    note = f"; this NVRTC cannot target {_names(unsupported)}" if unsupported else ""
    return Outcome(True, f"{names} for {_names(archs)}{note}")


def _names(archs: tuple[int, ...] | list[int]) -> str:
    return ", ".join(f"sm_{a}" for a in archs)


def _without_cupy(device: torch.device) -> str:
    if device.type == "cuda":
        return (
            "skipped: CuPy is not installed, so scaledoptim's CUDA kernels cannot compile; the "
            f"fused optimizers run torch's fused ops on {device} instead (also sync-free, but "
            "grads are unscaled in place, and the checks below test that path). For the "
            f"kernels, {_FIX}, and run the doctor again"
        )
    return (
        "skipped: CuPy is not installed, and training on a CPU needs no CuPy (the fused "
        "optimizers run torch's fused ops there). To compile the CUDA kernels on this machine "
        f"(kernel authors, and a check before a GPU run), {_FIX}"
    )
