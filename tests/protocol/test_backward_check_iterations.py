"""configure_scaling(check_during_backward=True) across iterations: what the hooks folded into
``found_inf`` belongs to the grads they saw, so a backward whose grads are discarded (by the
optimizer's or the module's ``zero_grad``, or replaced) leaves nothing behind, and the hooks keep
no grad alive (Note [overlapped overflow check])."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import row

pytestmark = pytest.mark.usefixtures("kernel_backend")  # the hooks act on our kernels only


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _optimizer(model: torch.nn.Module) -> scaledoptim.Optimizer:
    opt = row("AdamW").make(model.parameters())
    return opt.configure_scaling(init_scale=2.0**8, check_during_backward=True)


def _backward(model: torch.nn.Module, scale, overflow: bool = False) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    if overflow:
        loss = loss * float("inf")
    scaledoptim.scale_outputs(loss, scale).backward()


DISCARDS = {
    "opt.zero_grad()": lambda model, opt: opt.zero_grad(),
    "opt.zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda model, opt: model.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False),
    "grads set to None by hand": lambda model, opt: [
        setattr(p, "grad", None) for p in model.parameters()
    ],
}


@pytest.mark.parametrize("discard", DISCARDS)
def test_a_discarded_overflowing_backward_does_not_skip_the_next_step(discard) -> None:
    model = _model()
    opt = _optimizer(model)
    _backward(model, opt.scale, overflow=True)  # e.g. a probe batch, then thrown away
    DISCARDS[discard](model, opt)
    _backward(model, opt.scale)
    before = [p.detach().clone() for p in model.parameters()]
    _, found_inf, scale = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 0.0
    assert scale.item() == 2.0**8  # not backed off
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_overflow_in_the_kept_backward_still_skips() -> None:
    model = _model()
    opt = _optimizer(model)
    _backward(model, opt.scale)
    opt.zero_grad()
    _backward(model, opt.scale, overflow=True)
    before = [p.detach().clone() for p in model.parameters()]
    _, found_inf, scale = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0 and scale.item() == 2.0**7
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("scaled", [True, False], ids=["S", "S=None"])
def test_zero_grad_frees_the_grads(scaled) -> None:
    model = _model()
    opt = _optimizer(model)
    for _ in range(2):
        opt.zero_grad()
        _backward(model, opt.scale if scaled else None)
        opt.unscale_and_step(grads_scaled_by=opt.scale if scaled else None)
    _backward(model, opt.scale if scaled else None)  # accumulated into the kept grads
    grads = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(g() is None for g in grads)
