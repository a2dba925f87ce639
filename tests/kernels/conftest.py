"""Fixtures of the kernel tests: small launch geometry so small tensors cross every boundary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:  # runs from a checkout without `pip install -e .`
    sys.path.insert(0, str(_REPO_ROOT))

from scaledoptim.kernels import launch_config  # noqa: E402
from tests.kernels.kernel_reference import CHUNK, EMULATOR_THREADS  # noqa: E402


@pytest.fixture(autouse=True)
def small_launch_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of CHUNK elements and EMULATOR_THREADS emulated threads."""
    monkeypatch.setattr(launch_config, "chunk_size", CHUNK)
    monkeypatch.setattr(launch_config, "emulator_threads_per_block", EMULATOR_THREADS)
