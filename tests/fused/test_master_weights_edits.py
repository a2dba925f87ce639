"""``master_weights=True`` and params edited between steps (weight clipping, max-norm, an outer
optimizer's step, re-initialisation, loading weights): the edit is kept, because the next step
first copies every element it changed into the fp32 master, and the master keeps its extra bits
everywhere else (Note [param edits under master weights] in scaledoptim/fused/rounding.py)."""

from __future__ import annotations

import pytest
import torch

from scaledoptim.testing.optim_db import rows
from tests.support.cases import Cases

pytestmark = pytest.mark.usefixtures("kernel_backend")

ROUNDING = [info for info in rows(fused=True) if info.rounding]


def _edit_clamp(model, p):
    with torch.no_grad():
        p.clamp_(-0.05, 0.05)


def _edit_copy(model, p):
    with torch.no_grad():
        p[:2].copy_(torch.full_like(p[:2], 0.75))


def _edit_load_state_dict(model, p):
    model.load_state_dict({k: v.clamp(-0.05, 0.05) for k, v in model.state_dict().items()})


def _edit_assign_data(model, p):
    p.data = torch.full_like(p, 0.25)


def _edit_set(model, p):
    with torch.no_grad():
        p.set_(torch.full_like(p, -0.5))


EDITS = {
    "clamp_ under no_grad": _edit_clamp,
    "part copied in": _edit_copy,
    "module.load_state_dict": _edit_load_state_dict,
    "p.data = t": _edit_assign_data,
    "p.set_(t)": _edit_set,
}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(dtype)


def _grads(model: torch.nn.Module, seed: int, skip: tuple[int, ...] = ()) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i, p in enumerate(model.parameters()):
        p.grad = None if i in skip else torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("info", ROUNDING, ids=str)
def test_an_edit_between_steps_is_kept(info) -> None:
    """Each edit x bf16 and fp16 params (cheap and alike: one item per row and backend, each
    failing case named)."""
    cases = Cases()
    for dtype in (torch.bfloat16, torch.float16):
        for edit in EDITS:
            with cases.case(f"{edit}, {dtype}"):
                _check_an_edit_between_steps_is_kept(info, edit, dtype)
    cases.assert_all_passed()


def _check_an_edit_between_steps_is_kept(info, edit: str, dtype: torch.dtype) -> None:
    model = _model(dtype)
    opt = info.make(model.parameters(), master_weights=True)
    for step in range(3):  # the state exists and the step plan is kept
        _grads(model, step)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    params = list(model.parameters())
    masters = [opt.state[p]["master_param"].clone() for p in params]
    EDITS[edit](model, params[0])
    edited = [p.detach().clone() for p in params]
    # A skipped step keeps the edit and takes it into the master: only where it changed the
    # param, so the master keeps its fp32 bits everywhere else.
    _grads(model, 10)
    params[1].grad[0] = float("inf")
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    for p, before, master in zip(params, edited, masters):
        assert torch.equal(p, before)
        now = opt.state[p]["master_param"]
        changed = master.to(dtype) != before
        assert torch.equal(now[changed], before.float()[changed])
        assert torch.equal(now[~changed], master[~changed])
    # A step that moves nothing stores the param rounded from the master: the edit again.
    for group in opt.param_groups:
        group["lr"] = 0.0
    _grads(model, 11)
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert all(torch.equal(p, before) for p, before in zip(params, edited))


@pytest.mark.parametrize("info", ROUNDING, ids=str)
def test_a_param_edited_while_it_has_no_grad_is_kept(info) -> None:
    model = _model(torch.bfloat16)
    opt = info.make(model.parameters(), master_weights=True)
    for step in range(3):
        _grads(model, step)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    params = list(model.parameters())
    _edit_clamp(model, params[0])
    edited = params[0].detach().clone()
    _grads(model, 5, skip=(0,))  # param 0 is not stepped this time
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    for group in opt.param_groups:
        group["lr"] = 0.0
    _grads(model, 6)
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert torch.equal(params[0], edited)


@pytest.mark.parametrize("info", ROUNDING, ids=str)
def test_a_loaded_master_is_the_truth(info) -> None:
    """A resumed run: the checkpoint's masters, not the params' rounded bits, carry on."""
    model = _model(torch.bfloat16)
    opt = info.make(model.parameters(), master_weights=True)
    for step in range(3):
        _grads(model, step)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict()}
    resumed = _model(torch.bfloat16)
    resumed_opt = info.make(resumed.parameters(), master_weights=True)
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed.load_state_dict(checkpoint["model"])  # after the optimizer: still a resume
    for twin, twin_opt in ((model, opt), (resumed, resumed_opt)):
        _grads(twin, 7)
        twin_opt.unscale_and_step(grads_scaled_by=twin_opt.scale)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["master_param"], resumed_opt.state[b]["master_param"])
