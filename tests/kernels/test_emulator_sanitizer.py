"""The kernels stay in bounds for odd sizes and misaligned views, checked by AddressSanitizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prerequisites import missing

SCRIPT = Path(__file__).parent / "data" / "sanitized_launches.py"


def libasan() -> str | None:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return None
    path = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def run_sanitized(mode: str) -> subprocess.CompletedProcess:
    library = libasan()
    if library is None:
        missing("needs g++ with libasan (AddressSanitizer runtime)")
    env = {
        **os.environ,
        "LD_PRELOAD": library,
        "ASAN_OPTIONS": "detect_leaks=0:alloc_dealloc_mismatch=0",
        "SCALEDOPTIM_EMULATOR_SANITIZE": "address",
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), mode], capture_output=True, text=True, env=env, timeout=300
    )


def test_odd_sizes_and_misaligned_views_stay_in_bounds():
    result = run_sanitized("clean")
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-4000:]


def test_sanitizer_catches_an_out_of_bounds_table():
    result = run_sanitized("overflow")
    assert result.returncode != 0 and "heap-buffer-overflow" in result.stderr, (
        result.stdout,
        result.stderr[-4000:],
    )
