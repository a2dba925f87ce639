"""Accelerate keeps process-wide singletons (the accelerator's and the gradient-accumulation
state): a test that builds an ``Accelerator`` must leave them reset for the next one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    """Resets Accelerate's singletons after each test of a module that imports this fixture."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
