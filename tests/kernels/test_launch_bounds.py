"""Every kernel launches at any block size LaunchConfig allows (Note [launch bounds] in
cuda/common.cuh): compiled by NVRTC for sm_80 and the newest arch the installed NVRTC supports
(no GPU needed; the cubins test_nvrtc.py compiles), each instantiation uses at most the
registers a block of MAX_THREADS_PER_BLOCK threads may hold."""

from __future__ import annotations

import re

import pytest
from prerequisites import require_module

from scaledoptim.kernels import CUDA_SOURCE_DIR, MAX_THREADS_PER_BLOCK, builtin_kernels
from tests.support.cubin import cubin, registers_per_thread

require_module("cupy", "the launch-bounds check compiles through CuPy's NVRTC bindings")

from scaledoptim.kernels.nvrtc import supported_archs  # noqa: E402

#: 32-bit registers of one thread block from sm_80 on (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability").
REGISTERS_PER_BLOCK = 65536


@pytest.mark.parametrize("arch", sorted({80, supported_archs()[-1]}))
@pytest.mark.parametrize("kernel", builtin_kernels(), ids=lambda k: k.name)
def test_every_instantiation_fits_the_largest_block(kernel, arch):
    """Slow (NVRTC, per kernel and arch; the cubins are test_nvrtc.py's). Exists for a kernel that
    fails to launch at 1024 threads on a GPU: more than 64 registers per thread (a dropped
    ``__launch_bounds__``, or a change that spills past it), which nothing on a CPU runs into."""
    registers = registers_per_thread(cubin(kernel, arch))
    assert len(registers) == len(kernel.instantiations()), registers
    too_many = {
        name: count
        for name, count in registers.items()
        if count * MAX_THREADS_PER_BLOCK > REGISTERS_PER_BLOCK
    }
    assert not too_many, (
        f"{kernel.source.name} for sm_{arch}: registers per thread x {MAX_THREADS_PER_BLOCK} "
        f"threads > {REGISTERS_PER_BLOCK}, so a launch at that block size fails: {too_many}"
    )


def test_every_global_declares_the_launch_bounds_the_config_allows():
    common = (CUDA_SOURCE_DIR / "common.cuh").read_text()
    assert f"constexpr int kMaxThreadsPerBlock = {MAX_THREADS_PER_BLOCK};" in common
    for source in sorted(CUDA_SOURCE_DIR.glob("*.cu")):
        declarations = re.findall(r"__global__ void(.*)", source.read_text())
        assert declarations, source.name
        assert set(declarations) == {" __launch_bounds__(kMaxThreadsPerBlock)"}, source.name
