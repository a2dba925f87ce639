"""cuda_backend.unmet_requirement names what an install lacks for a device (Note [kernel probe]),
read from a fake CuPy: each piece missing in turn, then none."""

from __future__ import annotations

import re
import sys
import types
from typing import Any

import pytest
import torch

from scaledoptim.kernels import cuda_backend

CUDA = torch.device("cuda", 0)
NVRTC_13_ARCHS = (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)  # CUDA 13.0's list


def fake_cupy(archs: Any = NVRTC_13_ARCHS, driver: int = 13000, runtime: int = 13000) -> Any:
    def supported_archs() -> tuple[int, ...]:
        if isinstance(archs, Exception):
            raise archs
        return archs

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        nvrtc=types.SimpleNamespace(getSupportedArchs=supported_archs, getVersion=lambda: (13, 0)),
        runtime=types.SimpleNamespace(
            driverGetVersion=lambda: driver, runtimeGetVersion=lambda: runtime
        ),
    )
    return cupy


@pytest.fixture
def device_capability(monkeypatch: pytest.MonkeyPatch):
    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (major, minor))

    return set_capability


@pytest.mark.parametrize(
    ("cupy", "capability", "reason"),
    [
        (None, (9, 0), r"need CuPy; install the cuda12 extra"),
        (
            fake_cupy(OSError("libnvrtc.so.13: cannot open")),
            (9, 0),
            r"NVRTC cannot be loaded \(OSError: libnvrtc",
        ),
        (
            fake_cupy(),
            (7, 0),
            r"NVRTC 13\.0 cannot compile for sm_70 \(it targets sm_75 to sm_121\)",
        ),
        (fake_cupy(), (10, 1), r"cannot compile for sm_101"),
        (
            fake_cupy(driver=12080),
            (9, 0),
            r"CuPy was built for CUDA 13 and the driver supports CUDA 12",
        ),
    ],
)
def test_each_missing_piece_is_named_with_its_fix(
    monkeypatch, device_capability, cupy, capability, reason
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", cupy)  # None: `import cupy` raises ImportError
    device_capability(*capability)
    message = cuda_backend.unmet_requirement(CUDA)
    assert message is not None and re.search(reason, message), message
    assert '".[cuda12]"' in message and "scaledoptim[cuda12]" in message  # checkout and wheel


@pytest.mark.parametrize("capability", [(7, 5), (9, 0), (12, 1)])
def test_an_install_with_every_piece_lacks_nothing(
    monkeypatch, device_capability, capability
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    device_capability(*capability)
    assert cuda_backend.unmet_requirement(CUDA) is None
