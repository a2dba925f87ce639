"""Lion, Adagrad, LAMB and the rounding lists stay in bounds for odd sizes and misaligned views,
checked by AddressSanitizer (the runner of test_emulator_sanitizer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_emulator_sanitizer


def test_new_kernels_stay_in_bounds(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(
        test_emulator_sanitizer,
        "SCRIPT",
        Path(__file__).parent / "data" / "sanitized_new_launches.py",
    )
    result = test_emulator_sanitizer.run_sanitized("clean")
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-4000:]
