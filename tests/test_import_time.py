"""``import scaledoptim`` stays about as light as ``import torch`` (importing dynamo on import
once doubled it).

The time itself is measured by ``benchmarks/import_time.py`` (too noisy for a test); this checks
the cause: nothing heavy that only compiling needs is imported with the package
(Note [lazy compile boundary]).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch._dynamo", "torch._inductor", "sympy")


@pytest.mark.parametrize("module", ["scaledoptim", "scaledoptim.amp", "scaledoptim.optim"])
def test_import_leaves_dynamo_out(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_boundary_holds_once_dynamo_is_loaded() -> None:
    # A function behind the lazy boundary, called before dynamo is imported (directly) and
    # after, from compiled code: dynamo does not trace it, eagerly or in the frame it calls.
    # (torch's own Optimizer.add_param_group imports dynamo, so this uses a plain function.)
    code = """
import sys, torch
from scaledoptim import compile_boundary
seen = []

@compile_boundary.disable
def boundary(x):
    seen.append(torch.compiler.is_compiling())
    return x + 1

assert boundary(torch.zeros(1)).item() == 1.0
assert "torch._dynamo" not in sys.modules, "the boundary imported dynamo"

@torch.compile(backend="eager")
def compiled(x):
    return boundary(x * 2) * 3

assert compiled(torch.ones(1)).item() == 9.0
assert compiled(torch.ones(1)).item() == 9.0
assert seen == [False, False, False], seen
"""
    subprocess.run([sys.executable, "-c", code], check=True)
