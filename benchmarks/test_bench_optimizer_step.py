"""Optimizer step time: scaledoptim's unscale_and_step against GradScaler + torch's fused AdamW.

Run: ``python -m pytest benchmarks -p no:cacheprovider --benchmark-json=bench.json``. The ratio
table at the end of the run divides each median by the torch median of the same group.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim

SHAPES = {"1x25M": [25_000_000], "500x10k": [10_000] * 500}
SCALE = 2.0**16


def _params_with_grads(sizes: list[int]) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    grads = [torch.randn(n) * SCALE for n in sizes]
    return params, grads


def _reset(params, grads):
    # Both paths unscale the grads in place: restore them so no round runs on denormals.
    for p, g in zip(params, grads):
        p.grad.copy_(g)


def _run(benchmark, params, grads, step) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    step()  # state allocation out of the timed rounds
    benchmark.pedantic(step, setup=lambda: _reset(params, grads), rounds=15, warmup_rounds=2)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_gradscaler_fused_adamw(benchmark, shape) -> None:
    benchmark.group = f"adamw-step-cpu-{shape}"
    params, grads = _params_with_grads(SHAPES[shape])
    opt = torch.optim.AdamW(params, lr=1e-9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))  # GradScaler creates its scale lazily, at the first scale()

    def step():
        scaler.step(opt)
        scaler.update()

    _run(benchmark, params, grads, step)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaledoptim_adamw_unscale_and_step(benchmark, shape) -> None:
    benchmark.group = f"adamw-step-cpu-{shape}"
    params, grads = _params_with_grads(SHAPES[shape])
    opt = scaledoptim.AdamW(params, lr=1e-9).configure_scaling(init_scale=SCALE)
    S = opt.scale
    _run(benchmark, params, grads, lambda: opt.unscale_and_step(grads_scaled_by=S))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unscaled_torch_fused_adamw_for_reference(benchmark, shape) -> None:
    """The floor: torch's fused AdamW with no scaling at all."""
    benchmark.group = f"adamw-step-cpu-{shape}"
    params, grads = _params_with_grads(SHAPES[shape])
    opt = torch.optim.AdamW(params, lr=1e-9, fused=True)
    _run(benchmark, params, grads, opt.step)
