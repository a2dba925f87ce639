"""Fixtures for the scaledoptim.amp tests: import path and global policy state."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from scaledoptim import amp


@pytest.fixture(autouse=True)
def reset_amp_state():
    """Leave every test with torch's default policies and no autocast region open."""
    yield
    amp.reset_policy()
    assert amp.edited_policies() == {}
    assert not torch.is_autocast_enabled("cpu")
