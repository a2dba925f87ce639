"""Fixtures of the kernel tests: small launch geometry so small tensors cross every boundary."""

from __future__ import annotations

import pytest

from scaledoptim.kernels import launch_config
from tests.support.tensors import CHUNK, EMULATOR_THREADS


@pytest.fixture(autouse=True)
def small_launch_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of CHUNK elements and EMULATOR_THREADS emulated threads."""
    monkeypatch.setattr(launch_config, "chunk_size", CHUNK)
    monkeypatch.setattr(launch_config, "emulator_threads_per_block", EMULATOR_THREADS)
