"""Optimizer step time: scaledoptim's unscale_and_step against GradScaler + torch's optimizers,
for every fused row of optim_db with a torch.optim class (its default config, lr 1e-9).

Run: ``python -m pytest benchmarks -p no:cacheprovider --benchmark-json=bench.json``. The ratio
table at the end of the run divides each median by the GradScaler + fused torch median of the
same group (optimizer, device, parameter shapes). CUDA cases are skipped without a GPU, and a
torch class without a fused implementation on a device skips its fused cases there.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from bench_steps import DEVICES, SCALE, run, with_gradscaler

from scaledoptim.examples.models import CharTransformer
from scaledoptim.examples.tasks import SIZES
from scaledoptim.testing.optim_db import OptimInfo, rows


def _example_model_sizes() -> list[int]:
    """The example LM's parameter sizes at its GPU size (built on "meta": nothing allocated)."""
    size = SIZES["cuda"]
    with torch.device("meta"):
        model = CharTransformer(size.context, size.width, size.depth, heads=4)
    return [p.numel() for p in model.parameters()]


SHAPES = {"1x25M": [25_000_000], "500x10k": [10_000] * 500, "char-lm": _example_model_sizes()}
OPTIMIZERS = {info.name: info for info in rows(fused=True, reference=True)}

every_case = [
    pytest.mark.parametrize("shape", SHAPES, ids=str),
    pytest.mark.parametrize("device", DEVICES),
    pytest.mark.parametrize("optimizer", OPTIMIZERS),
]


def cases(test: Callable) -> Callable:
    for mark in every_case:
        test = mark(test)
    return test


def _torch(info: OptimInfo, params, **implementation) -> torch.optim.Optimizer:
    """The row's torch.optim class with the row's default config at lr 1e-9."""
    assert info.reference is not None
    return info.reference(params, **{**info.default.kwargs, "lr": 1e-9}, **implementation)


def _fused_or_skip(step: Callable[[], object]) -> Callable[[], object]:
    def first_call_may_skip() -> object:
        try:
            return step()
        except (NotImplementedError, RuntimeError) as error:  # no fused kernel on this device
            pytest.skip(f"torch's fused implementation does not run here: {error}")

    return first_call_may_skip


def _run(benchmark, optimizer: str, device: str, shape: str, make_step) -> None:
    run(benchmark, f"{optimizer}-{device}-{shape}", device, SHAPES[shape], make_step)


@cases
def test_torch_gradscaler_fused(benchmark, optimizer, device, shape) -> None:
    """The baseline: what torch.amp users run today at its fastest."""
    benchmark.extra_info["baseline"] = True
    info = OPTIMIZERS[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: _fused_or_skip(with_gradscaler(_torch(info, params, fused=True), device)))


@cases
def test_torch_gradscaler_foreach(benchmark, optimizer, device, shape) -> None:
    """torch's default implementation: GradScaler unscales, then the foreach step."""
    info = OPTIMIZERS[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: with_gradscaler(_torch(info, params, foreach=True), device))


@cases
def test_scaledoptim_unscale_and_step(benchmark, optimizer, device, shape) -> None:
    info = OPTIMIZERS[optimizer]

    def make_step(params):
        opt = info.make(params, lr=1e-9).configure_scaling(init_scale=SCALE)
        S = opt.scale
        return lambda: opt.unscale_and_step(grads_scaled_by=S)

    _run(benchmark, optimizer, device, shape, make_step)


@cases
def test_unscaled_torch_fused_for_reference(benchmark, optimizer, device, shape) -> None:
    """The floor: torch's fused step with no scaling at all."""
    info = OPTIMIZERS[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: _fused_or_skip(_torch(info, params, fused=True).step))
