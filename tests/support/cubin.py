"""Cubins of the built-in kernels, compiled once per test session, and the registers per thread
of each kernel in a cubin (an ELF file), as the GPU compiler recorded them: the
``EIATTR_REGCOUNT`` attributes of its ``.nv.info`` section, which ``cuobjdump -res-usage``
prints. No GPU needed."""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import struct
from concurrent.futures import Future, ProcessPoolExecutor

from scaledoptim.kernels import MultiTensorKernel, builtin_kernels

__all__ = ["cubin", "registers_per_thread"]


@functools.cache
def cubin(kernel: MultiTensorKernel, arch: int) -> bytes:
    """``compile_for_arch(kernel, arch)``, once per session: test_nvrtc.py compiles every kernel
    for sm_80 and the newest arch among others, and test_launch_bounds.py reads the registers of
    those same cubins (NVRTC takes seconds per kernel and arch, the largest part of the suite's
    time). The first built-in kernel asked for an arch has every built-in kernel compiled for
    it, on every core (one process each: NVRTC holds the GIL); a compile error is raised for its
    kernel."""
    from scaledoptim.kernels.nvrtc import compile_for_arch

    # By the whole kernel, as this cache: a variant of a built-in kernel with other lists has
    # another text (See Note [list enums] in kernels/sources.py).
    if kernel in builtin_kernels() and kernel in (compiles := _builtin_compiles(arch)):
        return compiles[kernel].result()
    return compile_for_arch(kernel, arch)


@functools.cache
def _builtin_compiles(arch: int) -> dict[MultiTensorKernel, Future[bytes]]:
    pool = _pool()
    return {k: pool.submit(_compile, k, arch) for k in builtin_kernels()}


@functools.cache
def _pool() -> ProcessPoolExecutor:
    pool = ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    atexit.register(pool.shutdown)
    return pool


def _compile(kernel: MultiTensorKernel, arch: int) -> bytes:
    # The kernel travels pickled (its args type by reference, so its module is imported). Every
    # built-in kernel is defined here too: the enums of a file's other kernels are in its text.
    import scaledoptim  # noqa: F401
    from scaledoptim.kernels.nvrtc import compile_for_arch

    return compile_for_arch(kernel, arch)

_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04  # a 16-bit size, then that many bytes; the other forms have 4 bytes in all


def registers_per_thread(cubin: bytes) -> dict[str, int]:
    """The registers each thread of each ``__global__`` function uses, by mangled name."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (section_table,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, section_table + i * entry_size)
        for i in range(count)
    ]

    def c_string(offset: int) -> str:
        return cubin[offset : cubin.index(b"\0", offset)].decode()

    names_at = sections[names_index][4]
    by_name = {c_string(names_at + s[0]): s for s in sections}
    symbols, strings = by_name[".symtab"], sections[by_name[".symtab"][6]]
    symbol_names = [
        c_string(strings[4] + struct.unpack_from("<I", cubin, symbols[4] + i * 24)[0])
        for i in range(symbols[5] // 24)  # Elf64_Sym: 24 bytes, its name first
    ]
    info = by_name[".nv.info"]
    registers = {}
    at, end = info[4], info[4] + info[5]
    while at < end:
        form, attribute, size = struct.unpack_from("<BBH", cubin, at)
        if form == _EIFMT_SVAL and attribute == _EIATTR_REGCOUNT:
            symbol, value = struct.unpack_from("<II", cubin, at + 4)
            registers[symbol_names[symbol]] = value
        at += 4 + (size if form == _EIFMT_SVAL else 0)
    return registers
