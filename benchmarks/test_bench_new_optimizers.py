"""Step time of the fused rows of optim_db that torch.optim lacks (Lion, LAMB) against the
nearest torch path, as ratios in one run.

Run: ``python -m pytest benchmarks/test_bench_new_optimizers.py -p no:cacheprovider``. Each group
(optimizer, device, parameter shapes) divides by its baseline: GradScaler + a foreach version of
the optimizer written here (a row without one times scaledoptim alone). scaledoptim runs
``unscale_and_step`` on the default backend of the device, with the row's default config at lr
1e-9. The rows with a torch.optim class are in test_bench_optimizer_step.py. CUDA cases are
skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from bench_steps import DEVICES, SCALE, run, with_gradscaler

from scaledoptim.testing.optim_db import rows


class ForeachLion(torch.optim.Optimizer):
    """Lion with torch's foreach ops, as a user would write it."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            m = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            (b1, b2), lr = group["betas"], group["lr"]
            c = torch._foreach_lerp(m, grads, 1 - b1)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_add_(params, torch._foreach_sign(c), alpha=-lr)
            torch._foreach_lerp_(m, grads, 1 - b2)


class ForeachLAMB(torch.optim.Optimizer):
    """LAMB (AdamW mode, clipping, trust ratio) with torch's foreach ops, as a user would write
    it."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0
    ):
        super().__init__(
            params,
            dict(
                lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm
            ),
        )

    @torch.no_grad()
    def step(self, closure=None):
        grads_all = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads_all)))
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            (b1, b2), wd = group["betas"], group["weight_decay"]
            grads = torch._foreach_div(
                [p.grad for p in params], torch.clamp(norm / group["max_grad_norm"], min=1)
            )
            states = [self.state[p] for p in params]
            for s, p in zip(states, params):
                if not s:
                    s.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                s["step"] += 1
            m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            step = states[0]["step"]
            update = torch._foreach_div(m, 1 - b1**step)
            denom = torch._foreach_add(
                torch._foreach_sqrt(torch._foreach_div(v, 1 - b2**step)), group["eps"]
            )
            torch._foreach_div_(update, denom)
            torch._foreach_add_(update, params, alpha=wd)
            ratios = [
                pn / un for pn, un in zip(torch._foreach_norm(params), torch._foreach_norm(update))
            ]
            torch._foreach_mul_(update, ratios)
            torch._foreach_add_(params, update, alpha=-group["lr"])


SHAPES = {"1x4M": [4_000_000], "500x10k": [10_000] * 500}
OPTIMIZERS = {info.name: info for info in rows(fused=True, reference=False)}
#: The torch baseline of a row: a foreach version of its math, as a user would write it.
FOREACH = {"Lion": ForeachLion, "LAMB": ForeachLAMB}

every_case = [
    pytest.mark.parametrize("shape", SHAPES, ids=str),
    pytest.mark.parametrize("device", DEVICES),
    pytest.mark.parametrize("optimizer", OPTIMIZERS),
]


def cases(test):
    for mark in every_case:
        test = mark(test)
    return test


def _run(benchmark, optimizer: str, device: str, shape: str, make_step) -> None:
    run(benchmark, f"{optimizer}-{device}-{shape}", device, SHAPES[shape], make_step)


@cases
def test_torch_baseline_with_gradscaler(benchmark, optimizer, device, shape) -> None:
    """The nearest torch path: GradScaler, then a foreach version of the optimizer."""
    benchmark.extra_info["baseline"] = True
    if optimizer not in FOREACH:
        pytest.skip(f"no foreach {optimizer} written here to compare with")
    foreach_class = FOREACH[optimizer]
    _run(benchmark, optimizer, device, shape,
         lambda params: with_gradscaler(foreach_class(params, lr=1e-9), device))


@cases
def test_scaledoptim_unscale_and_step(benchmark, optimizer, device, shape) -> None:
    info = OPTIMIZERS[optimizer]

    def make_step(params):
        opt = info.make(params, lr=1e-9).configure_scaling(init_scale=SCALE)
        S = opt.scale
        return lambda: opt.unscale_and_step(grads_scaled_by=S)

    _run(benchmark, optimizer, device, shape, make_step)
