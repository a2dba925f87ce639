"""cuda_backend.launch hands the driver what the installed CuPy's API gives, without a GPU: a fake
CuPy whose RawModule.get_function returns an object with exactly the public attributes of the
installed ``cupy.RawKernel`` (its driver function an object shaped like
``cupy.cuda.function.Function``), and whose ``driver.launchKernel`` records its arguments. Names
read from the real classes: a CuPy that renames them fails here, not on a GPU."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from prerequisites import require_module

from scaledoptim.kernels import NON_FINITE_CHECK, cuda_backend

cupy = require_module("cupy", "the fake is shaped like the installed CuPy's classes")

FUNCTION_POINTER, STREAM = 0xF00D, 0x57EA


def shaped_like(real: type, **given: Callable[[], Any]) -> Any:
    """An object with the public attribute names of the class ``real``: each of ``given`` reads as
    its callable's result, every other one fails the test when read."""
    names = {name for name in dir(real) if not name.startswith("_")}
    assert given.keys() <= names, f"the installed {real.__qualname__} has no {given.keys() - names}"

    def attribute(name: str) -> property:
        if name in given:
            return property(lambda self: given[name]())
        return property(lambda self: pytest.fail(f"the launcher read {real.__qualname__}.{name}"))

    return type(f"Fake{real.__name__}", (), {name: attribute(name) for name in names})()


class FakeCupy:
    """The parts of CuPy the launcher uses, recording what it is asked."""

    def __init__(self) -> None:
        self.devices: list[int] = []  # the device stack of ``cuda.Device``
        self.modules: list[dict[str, Any]] = []
        self.kernels_read_on: list[int] = []
        self.launches: list[tuple[Any, ...]] = []
        self.module = types.ModuleType("cupy")
        self.module.RawModule = self.raw_module
        self.module.cuda = types.SimpleNamespace(
            Device=self.device,
            compiler=types.SimpleNamespace(
                CompileException=type("CompileException", (Exception,), {})
            ),
            driver=types.SimpleNamespace(launchKernel=lambda *args: self.launches.append(args)),
        )

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        self.devices.append(index)
        try:
            yield
        finally:
            self.devices.pop()

    def raw_module(self, code: str, options: tuple[str, ...], name_expressions: list[str]) -> Any:
        self.modules.append(dict(code=code, options=options, names=name_expressions))
        return types.SimpleNamespace(get_function=self.get_function)

    def get_function(self, name: str) -> Any:
        """A RawKernel's shape; its ``kernel`` (the driver function) is read on a device."""
        function = shaped_like(cupy.cuda.function.Function, ptr=lambda: FUNCTION_POINTER)

        def kernel() -> Any:
            self.kernels_read_on.append(self.devices[-1])
            return function

        return shaped_like(cupy.RawKernel, kernel=kernel)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake.module)
    monkeypatch.setattr(cuda_backend, "_modules", {})
    monkeypatch.setattr(cuda_backend, "_functions", {})
    streams: list[int] = []

    def current_stream(index: int) -> Any:
        streams.append(index)
        return types.SimpleNamespace(cuda_stream=STREAM)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return fake


def test_launch_passes_the_driver_function_grid_block_stream_and_params(fake_cupy) -> None:
    instantiation = NON_FINITE_CHECK.instantiations()[0]
    params = (ctypes.c_void_p * 3)()
    for grid in (7, 9):  # the second launch reuses the loaded function
        cuda_backend.launch(
            NON_FINITE_CHECK, instantiation, params, grid, 256, torch.device("cuda", 1)
        )
    assert fake_cupy.launches == [
        (FUNCTION_POINTER, grid, 1, 1, 256, 1, 1, 0, STREAM, ctypes.addressof(params), 0)
        for grid in (7, 9)
    ]
    assert fake_cupy.kernels_read_on == [1]  # once, on the launch's device
    [module] = fake_cupy.modules
    assert module["names"] == NON_FINITE_CHECK.instantiations()
    assert "--fmad=false" in module["options"] and NON_FINITE_CHECK.source.name in module["code"]


def test_each_device_loads_its_own_function(fake_cupy) -> None:
    instantiation = NON_FINITE_CHECK.instantiations()[0]
    params = (ctypes.c_void_p * 1)()
    for index in (0, 1, 0):
        cuda_backend.launch(
            NON_FINITE_CHECK, instantiation, params, 1, 32, torch.device("cuda", index)
        )
    assert fake_cupy.kernels_read_on == [0, 1]
    assert len(fake_cupy.modules) == 2 and len(fake_cupy.launches) == 3
