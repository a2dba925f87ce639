"""Host cost of a step: the Python and dispatch work around the launches, per param tensor.

scaledoptim's kernel path runs on CPU tensors with ``SCALEDOPTIM_KERNELS=emulate`` and every kernel
launch replaced by a no-op, so what is timed is exactly what a GPU step would cost the host. Three
things to compare with in the same run, so that no ratio rests on a baseline measured under other
conditions:

* the baseline, the floor: torch's raw aten dispatch of the same work on meta tensors (the
  check-and-unscale op, the step counters' add and ``_fused_adamw_``; no kernel runs, no
  torch.optim Python);
* torch.optim's fused AdamW with GradScaler's unscale on meta tensors (torch's Python and
  dispatch, no kernel);
* a real CPU step: GradScaler (unscale_, step, update) around torch's fused AdamW, on CPU tensors
  of the same tiny size (its kernels run, but on 16 elements they cost little).

All with grads kept between steps (``zero_grad(set_to_none=False)``) and reallocated every step
(``set_to_none=True``, torch's default). The ratio table at the end also prints the extra
microseconds per tensor over the floor (``calls`` = tensors) and whether each median meets the
target: at most 1.0 us per tensor + 40 us.
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
    benchmark.pedantic(
        lambda: opt.unscale_and_step(grads_scaled_by=opt.scale),
        setup=setup,
        rounds=15,
        warmup_rounds=2,
    )


@pytest.mark.parametrize("grads", ["persistent", "reallocated"])
@pytest.mark.parametrize("n", TENSORS)
def test_torch_fused_adamw_with_gradscaler_unscale_on_meta(
    benchmark, monkeypatch, n, grads
) -> None:
    monkeypatch.setattr(torch_adam, "_device_dtype_check_for_fused", lambda *a, **k: None)
    params = [torch.nn.Parameter(torch.empty(NUMEL, device="meta")) for _ in range(n)]
    for p in params:
        p.grad = torch.empty(NUMEL, device="meta")
    opt = torch.optim.AdamW(params, fused=True)
    found_inf, inv_scale = torch.zeros((), device="meta"), torch.ones((), device="meta")

    def step():
        torch._amp_foreach_non_finite_check_and_unscale_(
            [p.grad for p in params], found_inf, inv_scale
        )
        opt.grad_scale, opt.found_inf = None, found_inf
        opt.step()

    step()

    def setup():
        if grads == "reallocated":
            for p in params:
                p.grad = torch.empty(NUMEL, device="meta")

    benchmark.group = f"host cost, {n} tensors, grads {grads}"
    benchmark.extra_info["calls"] = n
    benchmark.pedantic(step, setup=setup, rounds=15, warmup_rounds=2)


@pytest.mark.parametrize("grads", ["persistent", "reallocated"])
@pytest.mark.parametrize("n", TENSORS)
def test_torch_raw_aten_dispatch_on_meta(benchmark, n, grads) -> None:
    """The floor: the ops of a check + fused AdamW step, dispatched straight to aten on meta."""

    def meta() -> list[torch.Tensor]:
        return [torch.empty(NUMEL, device="meta") for _ in range(n)]

    params, grad_list, exp_avgs, exp_avg_sqs = meta(), meta(), meta(), meta()
    steps = [torch.zeros((), device="meta") for _ in range(n)]
    found_inf, inv_scale = torch.zeros((), device="meta"), torch.ones((), device="meta")

    def step():
        torch._amp_foreach_non_finite_check_and_unscale_(grad_list, found_inf, inv_scale)
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            params, grad_list, exp_avgs, exp_avg_sqs, [], steps, lr=1e-3, beta1=0.9,
            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
            grad_scale=None, found_inf=found_inf,
        )

    step()

    def setup():
        if grads == "reallocated":
            grad_list[:] = meta()

    benchmark.group = f"host cost, {n} tensors, grads {grads}"
    benchmark.extra_info["baseline"] = True
    benchmark.extra_info["calls"] = n
    benchmark.pedantic(step, setup=setup, rounds=15, warmup_rounds=2)


@pytest.mark.parametrize("grads", ["persistent", "reallocated"])
@pytest.mark.parametrize("n", TENSORS)
def test_torch_gradscaler_fused_adamw_on_cpu(benchmark, n, grads) -> None:
    """A real CPU step as users run it: GradScaler around torch's fused AdamW."""
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(NUMEL)
    opt = torch.optim.AdamW(params, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))

    def step():
        scaler.step(opt)
        scaler.update()

    step()

    def setup():
        for p in params:
            if grads == "reallocated":
                p.grad = torch.empty(NUMEL)
            p.grad.normal_()

    benchmark.group = f"host cost, {n} tensors, grads {grads}"
    benchmark.extra_info["calls"] = n
    benchmark.pedantic(step, setup=setup, rounds=15, warmup_rounds=2)
