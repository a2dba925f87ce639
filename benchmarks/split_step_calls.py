"""Host cost of the split form (``unscale()`` + ``step_after_unscale()``) against
``unscale_and_step()`` on one steady-state step: Python calls made inside scaledoptim (robust
on a loaded machine) and the median time, AdamW on the kernel path through the CPU emulator.
Also the median time of the split form's second check of its plan (the step cache's, with the
grads where ``unscale()`` left them), which ``step_after_unscale()`` makes before it steps.

Run: ``python benchmarks/split_step_calls.py [tensors] [numel]`` (default 500 x 1000).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

os.environ.setdefault("SCALEDOPTIM_KERNELS", "emulate")

import torch

import scaledoptim
from scaledoptim.protocol import steps


def _calls(run: Callable[[], None]) -> int:
    package = os.path.dirname(scaledoptim.__file__)
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(package):
            count += 1

    sys.setprofile(profile)
    run()
    sys.setprofile(None)
    return count


def main() -> None:
    tensors = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    numel = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    opt = scaledoptim.AdamW(params, lr=1e-3)

    def grads() -> None:  # reallocated every step, as after zero_grad(set_to_none=True)
        for p in params:
            p.grad = torch.full_like(p, 2.0)

    def split() -> None:
        opt.unscale(grads_scaled_by=opt.scale)
        opt.step_after_unscale()

    def fused() -> None:
        opt.unscale_and_step(grads_scaled_by=opt.scale)

    for form in (split, fused) * 3:  # past the first steps, which build state and the cache
        grads()
        form()
    print(f"scaledoptim {scaledoptim.__file__}")
    print(f"{tensors} x {numel}")
    for form in (split, fused):
        grads()
        calls = _calls(form)
        times = []
        for _ in range(15):
            grads()
            start = time.perf_counter()
            form()
            times.append(time.perf_counter() - start)
        median_ms = statistics.median(times) * 1e3
        print(f"  {form.__name__:6s} calls {calls:6d}  median {median_ms:8.2f} ms")
    times = []
    for _ in range(15):
        grads()
        opt.unscale(grads_scaled_by=opt.scale)
        start = time.perf_counter()
        steps.plan(opt)  # what step_after_unscale() checks first (Note [step cache])
        times.append(time.perf_counter() - start)
        opt.step_after_unscale()
    print(f"  second check of the split form: median {statistics.median(times) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
