"""A kernel that NVRTC rejects at launch time raises KernelCompileError with the compiler log,
as compile_for_arch does; CuPy's own CompileException never escapes. No GPU needed: CuPy's
RawModule is replaced by one whose compile fails."""

from __future__ import annotations

import ctypes
import sys
import types
from contextlib import nullcontext

import pytest
import torch
from prerequisites import require_module

from scaledoptim.kernels import NON_FINITE_CHECK, KernelCompileError, cuda_backend

NVRTC_LOG = (
    'non_finite_check.cu(12): error: identifier "undeclared_helper" is undefined\n1 error detected'
)


class StandInCompileException(Exception):
    """cupy.cuda.compiler.CompileException's shape: (msg, source, name, options); str is msg."""

    def __init__(self, msg: str, source: str, name: str, options: tuple[str, ...]) -> None:
        super().__init__(msg)


def _real_compile_exception() -> type[Exception]:
    cupy = require_module("cupy", "the CuPy variant raises CuPy's own CompileException")
    return cupy.cuda.compiler.CompileException


@pytest.fixture(params=["stand-in", "cupy"])
def compile_exception(request) -> type[Exception]:
    """The exception CuPy raises for an NVRTC failure (CuPy's own class where installed)."""
    return StandInCompileException if request.param == "stand-in" else _real_compile_exception()


def _fake_cupy(compile_exception: type[Exception], compiled: list[str]) -> types.ModuleType:
    class RawModule:
        def __init__(self, code: str, options: tuple[str, ...], name_expressions: list[str]):
            self.code, self.options = code, options

        def get_function(self, name: str):
            compiled.append(name)
            raise compile_exception(NVRTC_LOG, self.code, "non_finite_check.cu", self.options)

    cupy = types.ModuleType("cupy")
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(
        Device=lambda index: nullcontext(),
        compiler=types.SimpleNamespace(CompileException=compile_exception),
    )
    return cupy


def test_a_compile_failure_at_launch_raises_kernel_compile_error(compile_exception, monkeypatch):
    compiled: list[str] = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(compile_exception, compiled))
    monkeypatch.setattr(cuda_backend, "_modules", {})
    monkeypatch.setattr(cuda_backend, "_functions", {})
    instantiation = NON_FINITE_CHECK.instantiations()[0]

    for attempt in (1, 2):  # a failed compile is not cached as a usable module or function
        with pytest.raises(KernelCompileError) as error:
            cuda_backend.launch(
                NON_FINITE_CHECK,
                instantiation,
                (ctypes.c_void_p * 1)(),
                1,
                1,
                torch.device("cuda", 0),
            )
        message = str(error.value)
        assert NVRTC_LOG in message
        assert "non_finite_check.cu" in message.split("\n")[0] and instantiation in message
        assert error.value.__cause__ is None and error.value.__suppress_context__
        assert compiled == [instantiation] * attempt
    assert cuda_backend._functions == {} and cuda_backend._modules == {}
