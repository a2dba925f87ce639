"""The target architectures are what Note [target archs] says, and the doctor's compile check
names, per installed NVRTC, the targets it cannot compile for. The NVRTC lists are
``nvrtcGetSupportedArchs`` of the wheels nvidia-cuda-nvrtc-cu12 12.9.86, nvidia-cuda-nvrtc 13.0.88
and 13.5.37, read once with ctypes."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from prerequisites import require_module

from scaledoptim.doctor import compile_check
from scaledoptim.kernels import nvrtc

NVRTC_ARCHS = {
    (12, 9): (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121),
    (13, 0): (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121),
    (13, 5): (75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121),
}


def test_the_targets_are_every_arch_from_sm70_to_sm121_an_allowed_nvrtc_lists() -> None:
    listed = {a for archs in NVRTC_ARCHS.values() for a in archs if 70 <= a <= 121}
    assert nvrtc.TARGET_ARCHS == tuple(sorted(listed))


def test_the_note_states_the_lists_it_derives_the_targets_from() -> None:
    note = inspect.getsource(nvrtc).split("Note [target archs]")[1].split("TARGET_ARCHS =")[0]
    note = " ".join(line.strip("# ") for line in note.splitlines())
    for version in ((12, 9), (13, 0)):
        stated = re.search(rf"CUDA {version[0]}\.{version[1]}'s lists? ([\d, ]+)", note)
        assert stated, f"the note states no list for CUDA {version}"
        numbers = tuple(int(n) for n in re.findall(r"\d+", stated.group(1)))
        assert numbers == tuple(a for a in NVRTC_ARCHS[version] if 70 <= a <= 121)


def test_the_installed_nvrtc_lists_no_target_in_range_we_do_not_know() -> None:
    require_module("cupy", "reads the installed NVRTC's archs through CuPy")
    unknown = [a for a in nvrtc.installed_archs() if 70 <= a <= 121 and a not in nvrtc.TARGET_ARCHS]
    assert not unknown, f"this NVRTC also targets {unknown}: add them (Note [target archs])"


@pytest.fixture
def nvrtc_13(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The installed NVRTC reads as CUDA 13.0's; compiles are recorded, not run."""
    require_module("cupy", "the compile check runs only where CuPy is installed")
    compiled: list[int] = []
    monkeypatch.setattr(nvrtc, "installed_archs", lambda: NVRTC_ARCHS[(13, 0)])
    monkeypatch.setattr(
        nvrtc, "compile_for_arch", lambda kernel, arch: compiled.append(arch) or b"cubin"
    )
    return compiled


def test_the_compile_check_names_the_targets_this_nvrtc_cannot_compile_for(
    nvrtc_13, monkeypatch
) -> None:
    outcome = compile_check.run(torch.device("cpu"))
    assert outcome.passed and "for sm_75, sm_121;" in outcome.detail
    assert outcome.detail.endswith("this NVRTC cannot target sm_70, sm_72, sm_101, sm_107")
    assert set(nvrtc_13) == {75, 121}
    monkeypatch.setattr(compile_check, "ALL_ARCHS", True)
    nvrtc_13.clear()
    assert compile_check.run(torch.device("cpu")).passed
    assert sorted(set(nvrtc_13)) == [a for a in nvrtc.TARGET_ARCHS if a in NVRTC_ARCHS[(13, 0)]]


def test_the_compile_check_fails_a_gpu_this_nvrtc_cannot_target(nvrtc_13, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    outcome = compile_check.run(torch.device("cuda", 0))
    assert not outcome.passed and not nvrtc_13
    assert "cannot compile for sm_70 of cuda:0 (it targets sm_75, " in outcome.detail
    assert "the cuda12 extra for sm_70/sm_72" in outcome.detail
