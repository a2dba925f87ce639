"""Odd but legal input: every row of ``LEGAL`` is something unusual that must work, and asserts
the behaviour, over an Adam-family and an SGD optimizer (rows of optim_db chosen by name). What
must be refused is the refusal table's (tests/refusals/test_refusal_table.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import row
from tests.support.training import (
    assert_bit_identical,
    loss_of,
    make_model,
    ready_with_pending_backward,
    scaled_closure,
    snapshot,
)

OPTIMIZERS = [
    pytest.param((row("AdamW"), row("AdamW").default), id="AdamW-default"),
    pytest.param((row("SGD"), row("SGD").config("momentum-wd")), id="SGD-momentum-wd"),
]


def _ready(case):
    info, config = case
    return ready_with_pending_backward(info, config, growth_interval=5)


# ---------------------------------------------------------------------------- legal oddities
def _step_of_twin(case, edit_grads: Callable[[torch.nn.Module], None], scale=None):
    """Steps a fresh ready twin after ``edit_grads``; returns (model, opt, found_inf)."""
    model, opt = _ready(case)
    edit_grads(model)
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale if scale is None else scale)
    return model, opt, found_inf


def _same_as_twin(
    case, odd: Callable[[torch.nn.Module], None], plain: Callable[[torch.nn.Module], None]
):
    *_, odd_opt, _ = _step_of_twin(case, odd)
    *_, plain_opt, _ = _step_of_twin(case, plain)
    assert_bit_identical(snapshot(plain_opt), snapshot(odd_opt))


def some_grads_are_none(case):
    model, opt = _ready(case)
    model[2].bias.grad = None
    untouched = model[2].bias.detach().clone()
    state_before = copy.deepcopy(opt.state[model[2].bias])
    moved = model[0].weight.detach().clone()
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 0.0
    assert torch.equal(model[2].bias, untouched) and not torch.equal(model[0].weight, moved)
    assert all(torch.equal(v, opt.state[model[2].bias][k]) for k, v in state_before.items())


def every_grad_is_none(case):
    _, opt = _ready(case)
    opt.zero_grad()
    before = snapshot(opt)[:-3]  # without the scale's trackers: a clean (empty) step counts
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 0.0
    assert_bit_identical(before, snapshot(opt)[:-3])


def non_contiguous_grads(case):
    def transpose_layout(model):
        for p in model.parameters():
            if p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
                assert not p.grad.is_contiguous()

    _same_as_twin(case, transpose_layout, lambda model: None)


def low_precision_grad_for_fp32_param(case):
    """FSDP1's keep_low_precision_grads leaves bf16 grads on fp32 params."""
    def bf16(model):
        model[0].weight.grad.data = model[0].weight.grad.bfloat16()

    def rounded(model):
        model[0].weight.grad.copy_(model[0].weight.grad.bfloat16())

    _same_as_twin(case, bf16, rounded)


def float64_tensor_scale(case):
    *_, as_tensor, _ = _step_of_twin(
        case, lambda m: None, scale=torch.tensor(2.0**16, dtype=torch.float64)
    )
    *_, as_float, _ = _step_of_twin(case, lambda m: None, scale=2.0**16)
    assert_bit_identical(snapshot(as_float), snapshot(as_tensor))


def scale_that_requires_grad(case):
    scale = torch.tensor(2.0**16, requires_grad=True)
    *_, opt, found_inf = _step_of_twin(case, lambda m: None, scale=scale)
    assert found_inf.item() == 0.0 and opt.scale.item() == 2.0**16


def state_dict_after_dropping_a_pending_step(case):
    _, opt = _ready(case)
    opt.unscale(grads_scaled_by=opt.scale)
    opt.zero_grad()  # the fix the between-steps error names
    assert opt.state_dict()["loss_scale"]["scale"].item() == opt.scale.item()


def zero_grad_forgets_an_unconsumed_unscale(case):
    model, opt = _ready(case)
    opt.unscale(grads_scaled_by=opt.scale)
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, 3), opt.scale).backward()
    before = model[0].weight.detach().clone()
    opt.unscale(grads_scaled_by=opt.scale)  # no error: new grads
    opt.step_after_unscale()
    assert not torch.equal(model[0].weight, before)


def closure_returning_none(case):
    model, opt = _ready(case)
    closure = scaled_closure(model, opt)
    before = model[0].weight.detach().clone()
    loss, found_inf, _ = opt.unscale_and_step(
        lambda S: closure(S) and None, grads_scaled_by=opt.scale
    )
    assert loss is None and found_inf.item() == 0.0 and not torch.equal(model[0].weight, before)


LEGAL = [
    some_grads_are_none,
    every_grad_is_none,
    non_contiguous_grads,  # torch 2.13's CPU _fused_*_ misread them: the fused path must not
    low_precision_grad_for_fp32_param,
    float64_tensor_scale,
    scale_that_requires_grad,
    state_dict_after_dropping_a_pending_step,
    closure_returning_none,
    zero_grad_forgets_an_unconsumed_unscale,
]


@pytest.mark.parametrize("case", OPTIMIZERS)
@pytest.mark.parametrize("legal", LEGAL, ids=lambda f: f.__name__)
def test_legal_oddity_works(case, legal) -> None:
    legal(case)


def test_a_failed_found_inf_agreement_refuses_a_second_unscale_and_skips_the_step(
    monkeypatch,
) -> None:
    """If the all-reduce raises after the grads were unscaled in place, retrying unscale() would
    unscale them twice: it is refused, and the pending step is a skip (this rank cannot know
    whether another overflowed)."""
    import scaledoptim.protocol.steps as protocol

    model = make_model()
    opt = scaledoptim.AdamW(model.parameters())
    opt.scaling_state.process_group = object()  # stands in for a group whose collective fails

    def broken_all_reduce(found_inf, group):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(protocol, "agree_on_found_inf", broken_all_reduce)
    scaledoptim.scale_outputs(loss_of(model, 0), opt.scale).backward()
    with pytest.raises(RuntimeError, match="connection reset"):
        opt.unscale(grads_scaled_by=opt.scale)
    with pytest.raises(RuntimeError, match="already called"):
        opt.unscale(grads_scaled_by=opt.scale)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step_after_unscale()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
