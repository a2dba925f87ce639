"""Host cost per tensor of one steady-state step against torch's raw dispatch floor.

Ours: ``opt.unscale_and_step(grads_scaled_by=opt.scale)`` of an AdamW on the kernel path
(``SCALEDOPTIM_KERNELS=emulate``, every launch replaced by a no-op), so what is timed is what a
GPU step costs the host; the grads are reallocated before every step, as after
``zero_grad(set_to_none=True)``, so the step cache re-verifies and repoints every step.

The floor: torch's ``_amp_foreach_non_finite_check_and_unscale_`` and ``_fused_adamw_``
(``grad_scale=None``, ``found_inf``) dispatched straight to aten on meta tensors of the same
count (no kernel runs, no torch.optim Python), with reallocated grads too. Also printed: the
floor with the step counters' ``_foreach_add_`` that ``torch.optim.AdamW.step`` adds before the
fused op (ours advances its counters inside the kernel).

The three are timed alternately in one process, one step each per round, with the thread's CPU
time (``time.thread_time``: a step preempted on a shared host is not charged the other
process's time); each prints its min and median per tensor over the rounds, and ours as a ratio
of each floor, of the mins and of the medians (the goal: ours / floor <= 2). On a loaded host
the mins are the steadier: contention for caches and cores only adds to a step's CPU time.

    python benchmarks/host_cost.py [tensors ...] [--rounds 31]   (default 10 1000 5000)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ["SCALEDOPTIM_KERNELS"] = "emulate"

import torch

import scaledoptim
from scaledoptim.kernels import launcher

NUMEL = 16
WARMUP = 3

Case = tuple[Callable[[], None], Callable[[], None]]  # (step, setup before each step)


def floor(n: int, *, counters: bool) -> Case:
    """torch's raw aten dispatch of a check-and-unscale and a fused AdamW over ``n`` tensors
    on meta (with ``counters``, the step counters' add first, as ``AdamW.step`` does)."""

    def meta() -> list[torch.Tensor]:
        return [torch.empty(NUMEL, device="meta") for _ in range(n)]

    params, grads, exp_avgs, exp_avg_sqs = meta(), meta(), meta(), meta()
    steps = [torch.zeros((), device="meta") for _ in range(n)]
    found_inf, inv_scale = torch.zeros((), device="meta"), torch.ones((), device="meta")

    def step() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if counters:
            torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-3, beta1=0.9,
            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
            grad_scale=None, found_inf=found_inf,
        )

    def setup() -> None:
        grads[:] = meta()

    return step, setup


def ours(n: int) -> Case:
    """scaledoptim's AdamW step over ``n`` tensors, launches off, past the steps that build
    its state and step cache."""
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(n)]

    def setup() -> None:
        for p in params:
            p.grad = torch.empty(NUMEL)

    opt = scaledoptim.AdamW(params)
    for _ in range(2):
        setup()
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    return (lambda: opt.unscale_and_step(grads_scaled_by=opt.scale)), setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tensors", type=int, nargs="*", default=[10, 1000, 5000])
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    launcher.PreparedLaunch.run = lambda self, *a, **k: None  # type: ignore[method-assign]
    print(f"scaledoptim {os.path.dirname(scaledoptim.__file__)}, torch {torch.__version__}")
    print(f"load average {os.getloadavg()[0]:.2f}; us per tensor, min / median of {args.rounds}")
    for n in args.tensors:
        cases = {
            "floor": floor(n, counters=False),
            "floor+add": floor(n, counters=True),
            "ours": ours(n),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_ in range(WARMUP + args.rounds):
            for name, (step, setup) in cases.items():
                setup()
                start = time.thread_time()
                step()
                elapsed = time.thread_time() - start
                if round_ >= WARMUP:
                    times[name].append(elapsed / n * 1e6)
        low = {name: min(t) for name, t in times.items()}
        mid = {name: statistics.median(t) for name, t in times.items()}
        cells = "  ".join(f"{name} {low[name]:.3f} / {mid[name]:.3f}" for name in times)
        ratios = "  ".join(
            f"ours/{name} {low['ours'] / low[name]:.2f}x / {mid['ours'] / mid[name]:.2f}x"
            for name in ("floor", "floor+add")
        )
        print(f"n={n:5d}  {cells}  {ratios}", flush=True)


if __name__ == "__main__":
    main()
