"""Every fused row's update (its grad reduction, kernels and step epilogue, every config) and the
inf/nan check stay in bounds for odd sizes and misaligned views, checked by AddressSanitizer in
one subprocess (data/sanitized_launches.py) that reports each row."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from prerequisites import missing

from scaledoptim.testing.optim_db import rows

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
    return run_with_progress([sys.executable, str(SCRIPT), mode], env)


#: How long the script may go without printing a line (a kernel built, a row launched clean)
#: before it is taken for hung. Not a budget for the whole run: with a cold kernel cache at a
#: load of 50 on 2 cores, the builds alone took over 300 s, which a total timeout failed on.
STALL_S = 900.0


def run_with_progress(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)``, ended only when its stdout
    has been silent for :data:`STALL_S`."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")))
        reader.start()
        seen, last = 0, time.monotonic()
        while process.poll() is None:
            if len(lines) != seen:
                seen, last = len(lines), time.monotonic()
            elif time.monotonic() - last > STALL_S:
                process.kill()
                raise TimeoutError(f"{command} printed nothing for {STALL_S} s: hung")
            time.sleep(1.0)
        reader.join()
        stderr.seek(0)
        output = "".join(lines)
        return subprocess.CompletedProcess(command, process.returncode, output, stderr.read())


@pytest.fixture(scope="module")
def clean_run() -> subprocess.CompletedProcess:
    """One sanitized process launches every kernel (each start under ASan costs seconds)."""
    return run_sanitized("clean")


@pytest.mark.parametrize("name", [*(info.name for info in rows(fused=True)), "non_finite_check"])
def test_odd_sizes_and_misaligned_views_stay_in_bounds(clean_run, name):
    """Slow (one AddressSanitizer build of every kernel, shared by the rows). Exists for an
    out-of-bounds access: an unguarded scalar tail lane, a vector access where a chunk is
    misaligned, a read past the last tensor of a table (one is planted by
    test_sanitizer_catches_an_out_of_bounds_table); no other test fails for it."""
    # ASan aborts at the first bad access, so a launch that reads out of bounds, and every
    # launch after it, never reports clean.
    assert f"clean {name}" in clean_run.stdout.splitlines(), clean_run.stderr[-4000:]


def test_sanitizer_catches_an_out_of_bounds_table():
    result = run_sanitized("overflow")
    assert result.returncode != 0 and "heap-buffer-overflow" in result.stderr, (
        result.stdout,
        result.stderr[-4000:],
    )
