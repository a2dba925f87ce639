"""NVRTC's options, target archs and compile check, shared by the CUDA backend and the compile
check (the program text is :func:`~scaledoptim.kernels.sources.kernel_source`)."""

from __future__ import annotations

from .sources import CUDA_SOURCE_DIR, kernel_source
from .spec import MultiTensorKernel

__all__ = [
    "TARGET_ARCHS",
    "KernelCompileError",
    "compile_for_arch",
    "compile_options",
    "installed_archs",
    "supported_archs",
]

# Note [target archs]
# ~~~~~~~~~~~~~~~~~~~
# The kernels target every sm_XY from sm_70 (Volta) through sm_121 that an NVRTC the extras
# allow lists in nvrtcGetSupportedArchs (read from the wheels): CUDA 12.9's lists 70, 72, 75, 80,
# 86, 87, 89, 90, 100, 101, 103, 120, 121; CUDA 13.0's lists 75, 80, 86, 87, 88, 89, 90, 100,
# 103, 110, 120, 121; CUDA 13.5's adds 107. So the cuda13 extra cannot serve sm_70/sm_72 (V100,
# Xavier: use the cuda12 extra) nor sm_101 (CUDA 13 calls it sm_110), and the cuda12 extra not
# sm_88, sm_107, sm_110; NVRTC before 12.8 stops at sm_90. A device the installed NVRTC does not
# list is an expected absence (Note [kernel probe]): torch's ops there, with one warning.
#: Every architecture the kernels target (Note [target archs]).
TARGET_ARCHS = (70, 72, 75, 80, 86, 87, 88, 89, 90, 100, 101, 103, 107, 110, 120, 121)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


def compile_options(kernel: MultiTensorKernel) -> tuple[str, ...]:
    """NVRTC options without the architecture (CuPy adds the current device's)."""
    # No implicit contraction: kernels write fmaf where torch fuses, and the emulator (g++,
    # -ffp-contract=off) then computes the same bits as the GPU.
    return (
        "-std=c++17",
        "--fmad=false",
        f"-I{CUDA_SOURCE_DIR}",
        f"-I{kernel.source.resolve().parent}",
    )


def installed_archs() -> tuple[int, ...]:
    """Every ``sm_XY`` the installed NVRTC can compile for, as ``XY`` (CuPy's NVRTC)."""
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getSupportedArchs())


def supported_archs() -> tuple[int, ...]:
    """The :data:`TARGET_ARCHS` the installed NVRTC can compile for."""
    return tuple(a for a in TARGET_ARCHS if a in installed_archs())


def compile_for_arch(kernel: MultiTensorKernel, arch: int) -> bytes:
    """Compiles every instantiation of ``kernel`` to a cubin for ``sm_{arch}``; needs no GPU.

    Raises:
        KernelCompileError: with NVRTC's log when the source does not compile.
    """
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(kernel_source(kernel), kernel.source.name, [], [])
    try:
        for name in kernel.instantiations():
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(
                program, [*compile_options(kernel), f"--gpu-architecture=sm_{arch}"]
            )
        except nvrtc.NVRTCError as error:
            raise KernelCompileError(
                f"NVRTC could not compile {kernel.source} for sm_{arch} ({error}):\n"
                f"{nvrtc.getProgramLog(program)}"
            ) from None
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
