"""NVRTC program text and options, shared by the CUDA backend and the compile check."""

from __future__ import annotations

from .sources import CUDA_SOURCE_DIR, sources_fingerprint
from .spec import MultiTensorKernel

__all__ = [
    "TARGET_ARCHS",
    "KernelCompileError",
    "compile_for_arch",
    "compile_options",
    "program_source",
    "supported_archs",
]

# The architectures we promise to compile for (the NVRTC check tests those NVRTC supports).
TARGET_ARCHS = (70, 75, 80, 86, 89, 90)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


def program_source(kernel: MultiTensorKernel) -> str:
    """The kernel's source as NVRTC sees it.

    The first line fingerprints every header the source may include, because CuPy's on-disk
    cache keys on the program text only and would otherwise keep a module built from old headers.
    """
    fingerprint = sources_fingerprint(CUDA_SOURCE_DIR, kernel.source.resolve().parent)
    return (
        f"// scaledoptim sources {fingerprint}\n"
        f'#line 1 "{kernel.source.name}"\n'
        f"{kernel.source.read_text()}"
    )


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


def supported_archs() -> tuple[int, ...]:
    """The :data:`TARGET_ARCHS` the installed NVRTC can compile for."""
    from cupy.cuda import nvrtc

    return tuple(a for a in TARGET_ARCHS if a in nvrtc.getSupportedArchs())


def compile_for_arch(kernel: MultiTensorKernel, arch: int) -> bytes:
    """Compiles every instantiation of ``kernel`` to a cubin for ``sm_{arch}``; needs no GPU.

    Raises:
        KernelCompileError: with NVRTC's log when the source does not compile.
    """
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(program_source(kernel), kernel.source.name, [], [])
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
