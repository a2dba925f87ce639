"""Every kernel of KERNEL_CASES and each dtype instantiation compiles with NVRTC for every target
arch; no GPU needed. The table covers exactly the kernels scaledoptim launches."""

from __future__ import annotations

import pytest
from prerequisites import require_module

from scaledoptim.kernels import (
    KernelCompileError,
    MultiTensorKernel,
    NonFiniteCheckArgs,
    builtin_kernels,
)
from tests.kernels.kernel_table import KERNEL_CASES, case_id

cupy = require_module("cupy", "the NVRTC check compiles through CuPy's NVRTC bindings")

from scaledoptim.kernels.nvrtc import TARGET_ARCHS, compile_for_arch, supported_archs  # noqa: E402


def test_the_kernel_table_covers_every_builtin_kernel_once():
    assert sorted(case.kernel.name for case in KERNEL_CASES) == sorted(
        kernel.name for kernel in builtin_kernels()
    )
    assert {case.kernel for case in KERNEL_CASES} == set(builtin_kernels())


def test_installed_nvrtc_covers_current_gpus():
    assert {80, 90} <= set(supported_archs()), (
        f"NVRTC supports only {supported_archs()} of {TARGET_ARCHS}"
    )


@pytest.mark.parametrize(
    "arch", supported_archs() or [pytest.param(0, marks=pytest.mark.skip("no NVRTC arch"))]
)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=case_id)
def test_every_instantiation_compiles(case, arch):
    cubin = compile_for_arch(case.kernel, arch)  # KernelCompileError carries the NVRTC log
    assert cubin


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
