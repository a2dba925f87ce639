"""Counts the calls into scaledoptim during one steady-state ``unscale_and_step`` (AdamW, no
closure, no clipping) on each backend: torch's ops (the default on a CPU) and our kernels through
the CPU emulator (``SCALEDOPTIM_KERNELS=emulate``): how many calls, in how many files, and how
often consecutive calls cross a file boundary. The loop is the documented one: ``S`` is what the
previous step returned.

Run: ``python benchmarks/step_call_trace.py`` (``-v`` lists every call in order).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
from types import FrameType
from typing import Any

import torch

import scaledoptim

BACKENDS = {"torch": None, "kernels (emulated)": "emulate"}


def trace(mode: str | None) -> list[tuple[str, str]]:
    """The package calls of one steady step with ``SCALEDOPTIM_KERNELS=mode`` (unset: None)."""
    if mode is None:
        os.environ.pop("SCALEDOPTIM_KERNELS", None)
    else:
        os.environ["SCALEDOPTIM_KERNELS"] = mode
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    S = opt.scale

    def backward() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaledoptim.scale_outputs(loss, S).backward()

    for _ in range(4):  # past the first steps, which build state and the step cache
        backward()
        _, _, S = opt.unscale_and_step(grads_scaled_by=S)
    backward()

    package = os.path.dirname(scaledoptim.__file__)
    order: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            where = os.path.relpath(frame.f_code.co_filename, package)
            order.append((where, frame.f_code.co_name))

    sys.setprofile(profile)
    opt.unscale_and_step(grads_scaled_by=S)
    sys.setprofile(None)
    return order


def main() -> None:
    for name, mode in BACKENDS.items():
        order = trace(mode)
        calls = collections.Counter(where for where, _ in order)
        crossings = sum(1 for a, b in itertools.pairwise(order) if a[0] != b[0])
        print(f"{name}: calls {len(order)} files {len(calls)} file-crossings {crossings}")
        for where, count in calls.most_common():
            print(f"  {count:4d} {where}")
        if "-v" in sys.argv:
            for where, function in order:
                print(f"    {where} {function}")


if __name__ == "__main__":
    main()
