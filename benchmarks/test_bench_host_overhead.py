"""Host cost of a step: the Python and dispatch work around the launches, per param tensor.

scaledoptim's kernel path runs on CPU tensors with ``SCALEDOPTIM_KERNELS=emulate`` and every
kernel launch replaced by a no-op, so what is timed is exactly what a GPU step would cost the
host. The baseline is torch's fused AdamW step with GradScaler's unscale, on meta tensors (torch
dispatches and plans, no kernel runs). Both with grads kept between steps (``zero_grad(
set_to_none=False)``) and reallocated every step (``set_to_none=True``, torch's default). The
ratio table at the end also prints the extra microseconds per tensor over torch (``calls`` =
tensors) and whether each median meets the target: at most 1.0 us per tensor + 40 us.
"""

from __future__ import annotations

import pytest
import torch
import torch.optim.adam as torch_adam

import scaledoptim
from scaledoptim.kernels import launcher

TENSORS = (100, 1000, 5000)
NUMEL = 16
TARGET_US_PER_TENSOR, TARGET_US_FIXED = 1.0, 40.0


@pytest.fixture
def launches_off(monkeypatch):
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    monkeypatch.setattr(launcher.PreparedLaunch, "run", lambda self, *args, **kwargs: None)


@pytest.mark.parametrize("grads", ["persistent", "reallocated"])
@pytest.mark.parametrize("n", TENSORS)
def test_scaledoptim_kernel_path(benchmark, launches_off, n, grads) -> None:
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(n)]
    fresh = [torch.randn(NUMEL) for _ in range(n)]
    for p, g in zip(params, fresh):
        p.grad = g
    opt = scaledoptim.AdamW(params)
    opt.unscale_and_step(grads_scaled_by=opt.scale)  # creates the state

    def setup():
        if grads == "reallocated":
            for p in params:
                p.grad = torch.empty(NUMEL)

    benchmark.group = f"host cost, {n} tensors, grads {grads}"
    benchmark.extra_info["calls"] = n
    benchmark.extra_info["target_s"] = (TARGET_US_PER_TENSOR * n + TARGET_US_FIXED) * 1e-6
    benchmark.pedantic(lambda: opt.unscale_and_step(grads_scaled_by=opt.scale), setup=setup, rounds=15, warmup_rounds=2)


@pytest.mark.parametrize("grads", ["persistent", "reallocated"])
@pytest.mark.parametrize("n", TENSORS)
def test_torch_fused_adamw_with_gradscaler_unscale_on_meta(benchmark, monkeypatch, n, grads) -> None:
    monkeypatch.setattr(torch_adam, "_device_dtype_check_for_fused", lambda *a, **k: None)
    params = [torch.nn.Parameter(torch.empty(NUMEL, device="meta")) for _ in range(n)]
    for p in params:
        p.grad = torch.empty(NUMEL, device="meta")
    opt = torch.optim.AdamW(params, fused=True)
    found_inf, inv_scale = torch.zeros((), device="meta"), torch.ones((), device="meta")

    def step():
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found_inf, inv_scale)
        opt.grad_scale, opt.found_inf = None, found_inf
        opt.step()

    step()

    def setup():
        if grads == "reallocated":
            for p in params:
                p.grad = torch.empty(NUMEL, device="meta")

    benchmark.group = f"host cost, {n} tensors, grads {grads}"
    benchmark.extra_info["baseline"] = True
    benchmark.extra_info["calls"] = n
    benchmark.pedantic(step, setup=setup, rounds=15, warmup_rounds=2)
