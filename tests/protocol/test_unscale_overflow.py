"""The inf/nan check covers what the update reads: the unscaled grads.

At a scale below 1 (a scale backed off to 2**-20 is legal) a finite scaled grad, 9.5e32, unscales
to inf in float32. A check of the scaled grads misses it, and the update writes NaN into the
params; the check of the unscaled values skips the step instead, on every path: our kernels
(emulated), torch's ops, a generic optimizer, the split ``unscale()`` form and the check
overlapped with backward.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import rows
from tests.support.tensors import clones

pytestmark = pytest.mark.usefixtures("kernel_backend")  # our kernels (emulated) and torch's ops

TINY_SCALE = 2.0**-20
#: Finite in float32; times 2**20 it is above float32's max (3.4e38).
HUGE_SCALED_GRAD = 9.5e32
FORMS = ("unscale_and_step", "unscale + step_after_unscale", "check_during_backward")


def _fused(name: str):
    info = next(info for info in rows(fused=True) if info.name == name)
    return lambda params: info.make(params)


def _generic(cls: type[torch.optim.Optimizer]):
    return lambda params: scaledoptim.with_scaling(cls)(params, lr=0.01)


OPTIMIZERS = [
    *(pytest.param(_fused(info.name), id=info.name) for info in rows(fused=True)),
    *(
        pytest.param(_generic(cls), id=f"with_scaling({cls.__name__})")
        for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop)
    ),
]


def _backward(params: list[torch.Tensor], scaled_grads: list[torch.Tensor]) -> None:
    """A backward whose grads are ``scaled_grads`` (scaled by hand, as ``(loss * S)`` would)."""
    for param in params:
        param.grad = None
    sum((p * g).sum() for p, g in zip(params, scaled_grads)).backward()


def _step(opt, form: str) -> torch.Tensor:
    if form == "unscale + step_after_unscale":
        found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
        opt.step_after_unscale()
        return found_inf
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    return found_inf


def _state(opt) -> list[torch.Tensor]:
    return [
        value
        for param in (p for g in opt.param_groups for p in g["params"])
        for _, value in sorted(opt.state.get(param, {}).items())
        if isinstance(value, torch.Tensor)
    ]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("make", OPTIMIZERS)
def test_a_grad_that_unscales_to_inf_skips_the_step(make, form: str) -> None:
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5, 3))]
    opt = make(params)
    opt.configure_scaling(
        init_scale=TINY_SCALE, check_during_backward=form == "check_during_backward"
    )
    small = [torch.full_like(p, 1e-9) for p in params]  # unscaled: about 1e-3
    _backward(params, small)
    assert _step(opt, form).item() == 0.0  # a clean step creates the state
    huge = [g.clone() for g in small]
    huge[1][2, 1] = HUGE_SCALED_GRAD
    assert torch.isfinite(huge[1]).all() and not torch.isfinite(huge[1] / TINY_SCALE).all()
    _backward(params, huge)
    before = clones([p.detach() for p in params] + _state(opt))
    scale = opt.scale.item()

    found_inf = _step(opt, form)

    assert found_inf.item() == 1.0
    after = [p.detach() for p in params] + _state(opt)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.scale.item() == scale * 0.5  # backed off
