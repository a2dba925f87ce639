"""What the optimizer-step benchmarks share (no benchmarks here): the devices, the loss scale,
timing a step with fresh scaled grads before every round, and GradScaler around a torch
optimizer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

__all__ = ["DEVICES", "SCALE", "run", "with_gradscaler"]

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]
SCALE = 2.0**16


def _params_with_grads(sizes: list[int], device: str):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    grads = [torch.randn(n, device=device) * SCALE for n in sizes]
    return params, grads


def run(
    benchmark,
    group: str,
    device: str,
    sizes: list[int],
    make_step: Callable[[list[torch.nn.Parameter]], Callable[[], object]],
) -> None:
    """Times ``make_step(params)()`` with fresh scaled grads before every round."""
    benchmark.group = group
    params, grads = _params_with_grads(sizes, device)
    step = make_step(params)

    def timed() -> None:
        step()
        if device == "cuda":
            torch.cuda.synchronize()

    def reset() -> None:
        # Every path unscales the grads in place: restore them so no round runs on denormals.
        for p, g in zip(params, grads):
            p.grad.copy_(g)

    for p, g in zip(params, grads):
        p.grad = g.clone()
    timed()  # state allocation (and CUDA compilation) out of the timed rounds
    benchmark.pedantic(timed, setup=reset, rounds=15, warmup_rounds=2)


def with_gradscaler(opt: torch.optim.Optimizer, device: str) -> Callable[[], None]:
    scaler = torch.amp.GradScaler(device, init_scale=SCALE)
    scaler.scale(torch.ones((), device=device))  # GradScaler creates its scale at the first scale()

    def step() -> None:
        scaler.step(opt)
        scaler.update()

    return step
