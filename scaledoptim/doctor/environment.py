"""What the doctor runs on: versions, the device, and which backend a fused step takes."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform

import torch

import scaledoptim

from ..fused.backends import KernelProbeError, kernels_mode, select

__all__ = ["environment"]


def environment(device: torch.device) -> dict[str, str]:
    """The environment as ``name -> value`` strings (one line each)."""
    env = {
        "scaledoptim": scaledoptim.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (a CPU build of torch)",
        "cupy": _cupy_version(),
        "nvrtc": _nvrtc_version(),
        "device": _device_name(device),
        "compute_capability": _compute_capability(device),
        "SCALEDOPTIM_KERNELS": os.environ.get("SCALEDOPTIM_KERNELS", "(unset: auto)"),
    }
    try:
        kernels_mode()
        env["fused_step_backend"] = f"{select(device).name} on {device.type}"
    except ValueError as error:
        env["fused_step_backend"] = f"invalid: {error}"
    except KernelProbeError as error:
        env["fused_step_backend"] = f"none: {error}"
    return env


def _cupy_version() -> str:
    if importlib.util.find_spec("cupy") is None:
        return (
            "not installed (the CUDA kernels need it; the cuda12 extra installs it: "
            'pip install -e ".[cuda12]" in a checkout, pip install "scaledoptim[cuda12]" with '
            "a wheel)"
        )
    for name in ("cupy", "cupy-cuda12x", "cupy-cuda13x"):
        try:
            return f"{importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "importable, version unknown (no cupy distribution found)"


def _nvrtc_version() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "unavailable (scaledoptim reaches NVRTC through CuPy)"
    try:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
    except Exception as error:
        return f"unavailable ({type(error).__name__}: {error})".splitlines()[0]
    return f"{major}.{minor}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"cpu, {os.cpu_count()} cores (no CUDA device: GPU checks are skipped)"


def _compute_capability(device: torch.device) -> str:
    if device.type != "cuda":
        return "-"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor} (sm_{major}{minor})"
