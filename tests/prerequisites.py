"""Tests that need a tool CI always has (CuPy's NVRTC, g++'s AddressSanitizer, matplotlib)
skip on a developer's machine without it, but fail in CI (``CI`` set): there, a skip would be a
test passing by not running. Only GPU tests may skip in CI."""

from __future__ import annotations

import os
from typing import Any, NoReturn

import pytest


def missing(reason: str) -> NoReturn:
    """Skips the test (or the module, called at its top level), or fails it when running in CI."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test, but it {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, reason: str) -> Any:
    """``pytest.importorskip``, failing in CI instead of skipping."""
    try:
        return __import__(name)
    except ImportError:
        missing(f"needs {name}: {reason}")
