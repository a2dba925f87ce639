"""Step pre-hooks that edit grads count (a step used to plan before they ran, ignoring them).

``unscale_and_step`` and ``step_after_unscale`` commit through ``self.step()``, so step
pre-hooks run; a fused step now plans (validates, checks, unscales) after they ran, so what a
hook leaves is what the step uses: a grad it assigns, a grad it zeroes in place (a bf16 grad
included, which torch's ops would otherwise read through an fp32 copy made before the hook).
Hooks see the grads as the call found them: scaled in ``unscale_and_step``, unscaled after
``unscale()``. A hook that breaks a grad is refused before anything changes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import row

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(6, 5)),
        torch.nn.Parameter(torch.randn(7).to(torch.bfloat16)),
        torch.nn.Parameter(torch.randn(3)),
    ]


def _set_grads(params, S: float) -> None:
    gen = torch.Generator().manual_seed(3)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * S).to(p.dtype)


def assign_a_grad(params) -> None:
    params[0].grad = torch.full_like(params[0], 3.0) * params[0].grad.abs().max()


def zero_a_bf16_grad_in_place(params) -> None:
    params[1].grad.zero_()


def drop_a_grad(params) -> None:
    params[2].grad = None


EDITS = [assign_a_grad, zero_a_bf16_grad_in_place, drop_a_grad]


def _run(name: str, edit, form: str, hooked: bool):
    params = _params()
    opt = row(name).make(params)
    S = opt.scale.item()
    for _ in range(2):
        _set_grads(params, S)
        if form == "step_after_unscale":
            opt.unscale(grads_scaled_by=opt.scale)
        if hooked:
            handle = opt.register_step_pre_hook(lambda *args: edit(params))
        else:
            edit(params)  # the same edit, made before the call: what the hook must amount to
        if form == "unscale_and_step":
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        else:
            opt.step_after_unscale()
        if hooked:
            handle.remove()
    return params, opt


@pytest.mark.parametrize("form", ["unscale_and_step", "step_after_unscale"])
@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_a_step_pre_hook_that_edits_grads_counts(name, edit, form) -> None:
    hooked, hooked_opt = _run(name, edit, form, hooked=True)
    direct, direct_opt = _run(name, edit, form, hooked=False)
    for a, b in zip(hooked, direct):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert hooked_opt.scale.item() == direct_opt.scale.item()


def test_a_hook_that_breaks_a_grad_is_refused_before_anything_changes() -> None:
    params = _params()
    opt = scaledoptim.AdamW(params)
    _set_grads(params, opt.scale.item())
    opt.unscale_and_step(grads_scaled_by=opt.scale)  # state exists
    _set_grads(params, opt.scale.item())
    before = copy.deepcopy([params, opt.state_dict()])
    grads = [p.grad.clone() for p in params]

    def bad(*args):
        params[0].grad = torch.zeros(6, 5).to_sparse()  # refused: the step's checks must see it

    opt.register_step_pre_hook(bad)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    for a, b, g in zip(params, before[0], grads):
        assert torch.equal(a, b)
        if a is not params[0]:  # (the hook replaced that one)
            assert torch.equal(a.grad, g)
    after = opt.state_dict()
    for p in after["state"]:
        for k, v in after["state"][p].items():
            assert torch.equal(v, before[1]["state"][p][k]), k
    assert torch.equal(after["loss_scale"]["scale"], before[1]["loss_scale"]["scale"])
    assert torch.equal(
        after["loss_scale"]["growth_tracker"], before[1]["loss_scale"]["growth_tracker"]
    )
