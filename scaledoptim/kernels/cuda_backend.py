"""Launches on CUDA tensors: CuPy's NVRTC compiles the kernels, the driver launches them on
torch's current stream. CuPy is imported on first use only."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .nvrtc import KernelCompileError, compile_options
from .sources import kernel_source
from .spec import MultiTensorKernel

__all__ = ["launch", "unmet_requirement"]

_EXTRA = (
    'pip install -e ".[cuda12]"` in a checkout, or `pip install "scaledoptim[cuda12]"` '
    "where scaledoptim was installed from a wheel ([cuda13] for CUDA 13 drivers)"
)

# (kernel, device index) -> cupy.RawModule; (kernel, instantiation, device index) -> the driver
# function (cupy.cuda.function.Function). One module per device: a RawModule is compiled for the
# arch of the device it first runs on.
_modules: dict[tuple[MultiTensorKernel, int], Any] = {}
_functions: dict[tuple[MultiTensorKernel, str, int], Any] = {}


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as error:
        raise RuntimeError(
            f"Fused CUDA kernels need CuPy; install the cuda12 extra: `{_EXTRA}"
        ) from error
    return cupy


def unmet_requirement(device: torch.device) -> str | None:
    """What the installed CUDA stack lacks to compile and launch the kernels on ``device``, with
    the fix, or ``None``: CuPy not installed, NVRTC that cannot be loaded, a device arch the
    installed NVRTC does not list (Note [target archs] in nvrtc.py), or a driver older than the
    CUDA that CuPy was built for. Reads the install only; launches nothing."""
    try:
        cupy = _import_cupy()
    except RuntimeError as error:  # CuPy's own ImportError (not installed, or broken) as cause
        return f"{error} ({type(error.__cause__).__name__}: {error.__cause__})"
    try:
        archs = tuple(cupy.cuda.nvrtc.getSupportedArchs())
    except Exception as error:  # whatever CuPy raises for a library it cannot load
        return f"NVRTC cannot be loaded ({type(error).__name__}: {error}); install `{_EXTRA}"
    major, minor = torch.cuda.get_device_capability(device)
    if 10 * major + minor not in archs:
        version = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        return (
            f"NVRTC {version} cannot compile for sm_{major}{minor} (it targets sm_{archs[0]} to "
            f"sm_{archs[-1]}); install the extra of a CUDA whose NVRTC does: `{_EXTRA}"
        )
    driver, runtime = cupy.cuda.runtime.driverGetVersion(), cupy.cuda.runtime.runtimeGetVersion()
    if driver // 1000 < runtime // 1000:
        return (
            f"CuPy was built for CUDA {runtime // 1000} and the driver supports CUDA "
            f"{driver // 1000}; install the CuPy of the driver's CUDA: `{_EXTRA}"
        )
    return None


def _function(kernel: MultiTensorKernel, instantiation: str, device_index: int) -> Any:
    key = (kernel, instantiation, device_index)
    function = _functions.get(key)
    if function is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{kernel.name} would be compiled and loaded inside CUDA graph capture, which "
                "breaks the capture; take one eager step first, then capture"
            )
        cupy = _import_cupy()
        with cupy.cuda.Device(device_index):
            module = _modules.get((kernel, device_index))
            if module is None:
                module = cupy.RawModule(
                    code=kernel_source(kernel),
                    options=compile_options(kernel),
                    name_expressions=kernel.instantiations(),
                )
            try:
                # Compiles all instantiations at the first call. CuPy (13 and 14, the range the
                # extras allow) returns a RawKernel; its driver function, for the current
                # device, is `.kernel`, a Function whose `.ptr` is the CUfunction.
                function = module.get_function(instantiation).kernel
            except cupy.cuda.compiler.CompileException as error:
                raise KernelCompileError(
                    f"NVRTC could not compile {kernel.source.name} ({kernel.source}) for "
                    f"device {device_index} while loading {instantiation}; fix the source at "
                    f"the file(line) the log names:\n{error}"
                ) from None
            # Cached only once compiled, so a failed compile raises the same error every time.
            _modules[(kernel, device_index)] = module
        _functions[key] = function
    return function


def launch(
    kernel: MultiTensorKernel,
    instantiation: str,
    params: ctypes.Array,
    grid: int,
    block: int,
    device: torch.device,
) -> None:
    """Enqueues one launch on torch's current stream of ``device``; does not synchronize.

    ``params`` is cuLaunchKernel's kernelParams array; the driver copies the arguments (the
    table travels by value) at launch, so no host memory has to outlive this call.
    """
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    function = _function(kernel, instantiation, device_index)
    stream = torch.cuda.current_stream(device_index).cuda_stream
    cupy = _import_cupy()
    with cupy.cuda.Device(device_index):
        cupy.cuda.driver.launchKernel(
            function.ptr, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(params), 0
        )
