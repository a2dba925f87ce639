"""Fixtures for the scaledoptim.amp tests: the global policy state (tests/conftest.py puts the
repository on the import path)."""

from __future__ import annotations

import pytest
import torch

from scaledoptim import amp


@pytest.fixture(autouse=True)
def reset_amp_state():
    """Leave every test with torch's default policies and no autocast region open."""
    yield
    amp.reset_policy()
    assert amp.edited_policies() == {}
    assert not torch.is_autocast_enabled("cpu")
