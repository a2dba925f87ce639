"""Without CuPy (and without a GPU) the package imports, the emulator works, and the GPU tests
report skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

# Makes `import cupy` fail, as on a machine where it is not installed.
BLOCK_CUPY = f"import sys; sys.modules['cupy'] = None; sys.path.insert(0, {str(REPO)!r}); "


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_CUPY + code], capture_output=True, text=True, cwd=REPO
    )


def test_package_imports_and_emulates_without_cupy():
    result = run_python(
        "import torch, scaledoptim, scaledoptim.kernels as k\n"
        "assert 'cupy' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
        "f = torch.zeros(()); k.non_finite_check_([torch.tensor([1.0, float('nan')])], f)\n"
        "assert f.item() == 1.0; print('ok')"
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_cuda_launch_without_cupy_names_the_fix():
    if not torch.cuda.is_available():  # the message is all that can be checked here
        result = run_python(
            "from scaledoptim.kernels.cuda_backend import _import_cupy\n"
            "try:\n    _import_cupy()\nexcept RuntimeError as e:\n    print(e)"
        )
        assert 'pip install -e ".[cuda12]"` in a checkout' in result.stdout, result.stderr
        wheel = 'pip install "scaledoptim[cuda12]"` where scaledoptim was installed from a wheel'
        assert wheel in result.stdout


def test_gpu_tests_report_skipped_without_gpu_or_cupy():
    # The GPU-marked ones: tests/gpu's CPU twins (the same bodies on the emulator) run anywhere.
    code = (
        "import pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-m', "
        "'gpu', 'tests/gpu', 'benchmarks/test_bench_cuda_kernels.py']))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_CUPY + code], capture_output=True, text=True, cwd=REPO, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "skipped" in result.stdout
        and "passed" not in result.stdout
        and "failed" not in result.stdout
    )
