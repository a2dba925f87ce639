"""Optimizer step time: scaledoptim's unscale_and_step against GradScaler + torch's optimizers.

Run: ``python -m pytest benchmarks -p no:cacheprovider --benchmark-json=bench.json``. The ratio
table at the end of the run divides each median by the GradScaler + fused torch median of the
same group (optimizer, device, parameter shapes). CUDA cases are skipped without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import scaledoptim
from scaledoptim.examples.models import CharTransformer
from scaledoptim.examples.tasks import SIZES


def _example_model_sizes() -> list[int]:
    """The example LM's parameter sizes at its GPU size (built on "meta": nothing allocated)."""
    size = SIZES["cuda"]
    with torch.device("meta"):
        model = CharTransformer(size.context, size.width, size.depth, heads=4)
    return [p.numel() for p in model.parameters()]


SHAPES = {"1x25M": [25_000_000], "500x10k": [10_000] * 500, "char-lm": _example_model_sizes()}
OPTIMIZERS = {  # name: (torch class, scaledoptim class, hyper-parameters for both)
    "adamw": (torch.optim.AdamW, scaledoptim.AdamW, {"lr": 1e-9}),
    "sgd": (torch.optim.SGD, scaledoptim.SGD, {"lr": 1e-9, "momentum": 0.9}),
}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]
SCALE = 2.0**16

every_case = [
    pytest.mark.parametrize("shape", SHAPES, ids=str),
    pytest.mark.parametrize("device", DEVICES),
    pytest.mark.parametrize("optimizer", OPTIMIZERS),
]


def cases(test: Callable) -> Callable:
    for mark in every_case:
        test = mark(test)
    return test


def _params_with_grads(shape: str, device: str):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in SHAPES[shape]]
    grads = [torch.randn(n, device=device) * SCALE for n in SHAPES[shape]]
    return params, grads


def _run(benchmark, optimizer: str, device: str, shape: str, make_step) -> None:
    """Times ``make_step(params)()`` with fresh scaled grads before every round."""
    benchmark.group = f"{optimizer}-{device}-{shape}"
    params, grads = _params_with_grads(shape, device)
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


def _with_gradscaler(opt: torch.optim.Optimizer, device: str) -> Callable[[], None]:
    scaler = torch.amp.GradScaler(device, init_scale=SCALE)
    scaler.scale(torch.ones((), device=device))  # GradScaler creates its scale at the first scale()

    def step() -> None:
        scaler.step(opt)
        scaler.update()

    return step


@cases
def test_torch_gradscaler_fused(benchmark, optimizer, device, shape) -> None:
    """The baseline: what torch.amp users run today at its fastest."""
    benchmark.extra_info["baseline"] = True
    torch_class, _, kwargs = OPTIMIZERS[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: _with_gradscaler(torch_class(params, fused=True, **kwargs), device))  # fmt: skip


@cases
def test_torch_gradscaler_foreach(benchmark, optimizer, device, shape) -> None:
    """torch's default implementation: GradScaler unscales, then the foreach step."""
    torch_class, _, kwargs = OPTIMIZERS[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: _with_gradscaler(torch_class(params, foreach=True, **kwargs), device))  # fmt: skip


@cases
def test_scaledoptim_unscale_and_step(benchmark, optimizer, device, shape) -> None:
    _, scaled_class, kwargs = OPTIMIZERS[optimizer]

    def make_step(params):
        opt = scaled_class(params, **kwargs).configure_scaling(init_scale=SCALE)
        S = opt.scale
        return lambda: opt.unscale_and_step(grads_scaled_by=S)

    _run(benchmark, optimizer, device, shape, make_step)


@cases
def test_unscaled_torch_fused_for_reference(benchmark, optimizer, device, shape) -> None:
    """The floor: torch's fused step with no scaling at all."""
    torch_class, _, kwargs = OPTIMIZERS[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: torch_class(params, fused=True, **kwargs).step)  # fmt: skip
