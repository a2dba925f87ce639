"""Counts the calls into scaledoptim during one steady-state ``unscale_and_step`` (AdamW, no
closure, the kernel path through the CPU emulator): how many calls, in how many files, and how
often consecutive calls cross a file boundary.

Run: ``python benchmarks/step_call_trace.py`` (``-v`` lists every call in order).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
from types import FrameType
from typing import Any

os.environ["SCALEDOPTIM_KERNELS"] = "emulate"

import torch

import scaledoptim


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def backward() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaledoptim.scale_outputs(loss, opt.scale).backward()

    for _ in range(4):  # past the first steps, which build state and the step cache
        backward()
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    backward()

    package = os.path.dirname(scaledoptim.__file__)
    calls: collections.Counter[str] = collections.Counter()
    order: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            where = os.path.relpath(frame.f_code.co_filename, package)
            calls[where] += 1
            order.append((where, frame.f_code.co_name))

    sys.setprofile(profile)
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    sys.setprofile(None)
    crossings = sum(1 for a, b in itertools.pairwise(order) if a[0] != b[0])
    print(f"calls {sum(calls.values())} files {len(calls)} file-crossings {crossings}")
    for where, count in calls.most_common():
        print(f"  {count:4d} {where}")
    if "-v" in sys.argv:
        for where, name in order:
            print(f"    {where} {name}")


if __name__ == "__main__":
    main()
