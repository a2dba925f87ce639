"""Every kernel of ``scaledoptim.kernels.builtin_kernels()`` and each dtype instantiation compiles
with NVRTC for the oldest target arch the installed NVRTC supports, the oldest of each branch of
the sources on ``__CUDA_ARCH__``, and its newest (every one of them: ``python -m
scaledoptim.doctor --all-archs``); no GPU needed. The
built-in kernels are exactly the check (and its clipping form that sums squares), the epilogue
and the kernels the fused rows of optim_db launch (with 8-bit states too), so a new optimizer's
kernel is compiled here with no edit to this file."""

from __future__ import annotations

import re

import pytest
from prerequisites import require_module

from scaledoptim.kernels import (
    CUDA_SOURCE_DIR,
    NON_FINITE_CHECK,
    NON_FINITE_CHECK_NORM,
    STEP_EPILOGUE,
    KernelCompileError,
    MultiTensorKernel,
    NonFiniteCheckArgs,
    builtin_kernels,
)
from scaledoptim.testing.optim_db import rows
from tests.support.cubin import cubin

cupy = require_module("cupy", "the NVRTC check compiles through CuPy's NVRTC bindings")

from scaledoptim.kernels.nvrtc import TARGET_ARCHS, compile_for_arch, supported_archs  # noqa: E402


def test_the_builtin_kernels_are_the_check_the_epilogue_and_the_rows_kernels():
    launched = {
        kernel
        for info in rows(fused=True)
        for kernel in (*info.launched_kernels, *info.lowbit_kernels)
    }
    builtin = {NON_FINITE_CHECK, NON_FINITE_CHECK_NORM, STEP_EPILOGUE}
    assert set(builtin_kernels()) == {*builtin, *launched}
    assert len(builtin_kernels()) == len(set(builtin_kernels()))


def test_installed_nvrtc_covers_current_gpus():
    assert {80, 90} <= set(supported_archs()), (
        f"NVRTC supports only {supported_archs()} of {TARGET_ARCHS}"
    )


def _kernel_id(kernel: MultiTensorKernel) -> str:
    """Where its args mirror lives, and its name: unique even for two kernels of one source."""
    return f"{kernel.args_type.__module__.removeprefix('scaledoptim.')}.{kernel.name}"


def _each_branch(archs: tuple[int, ...]) -> list[int]:
    """The oldest arch, the oldest at each ``__CUDA_ARCH__ >= N`` the kernel sources branch on
    (sm_80: the hardware bf16 conversions), and the newest: an arch takes the same source as the
    oldest arch of its branch, so a compile error specific to an arch shows in one of them (the
    other archs in between are ``python -m scaledoptim.doctor --all-archs``'s). The launch
    bounds test reads the registers of sm_80's and the newest's."""
    if not archs:
        return []
    text = "\n".join(path.read_text() for path in sorted(CUDA_SOURCE_DIR.glob("*.cu*")))
    thresholds = {int(n) // 10 for n in re.findall(r"__CUDA_ARCH__\s*>=\s*(\d+)", text)}
    branches = [min((a for a in archs if a >= t), default=archs[-1]) for t in thresholds]
    return sorted({archs[0], *branches, archs[-1]})


@pytest.mark.parametrize(
    "arch",
    _each_branch(supported_archs())
    or [pytest.param(0, marks=pytest.mark.skip("no NVRTC arch"))],
)
@pytest.mark.parametrize("kernel", builtin_kernels(), ids=_kernel_id)
def test_every_instantiation_compiles(kernel, arch):
    """Slow (NVRTC, per kernel and arch). Exists for a kernel that does not compile for some target:
    an arch branch of the sources (the inline PTX bf16 conversion needs sm_80; a dropped
    ``__CUDA_ARCH__`` guard fails sm_70), a template instantiation only a dtype pair uses."""
    assert cubin(kernel, arch)  # KernelCompileError carries the NVRTC log


def test_a_broken_kernel_fails_with_the_nvrtc_log(tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text(
        '#include "multi_tensor_apply.cuh"\n'
        "struct NonFiniteCheckArgs { float* found_inf; };\n"
        "template <typename T>\n"
        "__global__ void broken_kernel(TensorTable<1> table, NonFiniteCheckArgs args) {\n"
        "  undeclared_helper(table);\n"
        "}\n"
    )
    kernel = MultiTensorKernel(
        source, "broken_kernel", ("tensors",), NonFiniteCheckArgs, dtype_lists=(0,)
    )
    with pytest.raises(KernelCompileError) as error:
        compile_for_arch(kernel, supported_archs()[0])
    message = str(error.value)
    assert 'broken.cu(5): error: identifier "undeclared_helper" is undefined' in message
