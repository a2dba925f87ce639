"""Bad input, broken closures, odd grads, corrupt checkpoints and calls out of order.

Every row of ``BAD`` must raise a clear error naming the fix and leave params, optimizer state
and the loss scale bit-identical. Every row of ``LEGAL`` is something unusual that must work:
there the row asserts the behaviour. Both tables run over an Adam-family and an SGD optimizer,
rows of optim_db chosen by name (the protocol does not branch on the update: the generic tests
over every row are tests/protocol/test_errors.py and tests/fused/test_plan_then_commit.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import row
from tests.support.training import (
    assert_bit_identical,
    loss_of,
    make_model,
    ready_with_pending_backward,
    snapshot,
)

OPTIMIZERS = [
    pytest.param((row("AdamW"), row("AdamW").default), id="AdamW-default"),
    pytest.param((row("SGD"), row("SGD").config("momentum-wd")), id="SGD-momentum-wd"),
]
NOOP: Callable[[Any, Any], None] = lambda model, opt: None  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Bad:
    name: str
    call: Callable[[torch.nn.Module, scaledoptim.Optimizer], Any]
    error: type[BaseException]
    match: str
    prepare: Callable[[torch.nn.Module, scaledoptim.Optimizer], Any] = NOOP  # before the snapshot

    def __str__(self) -> str:
        return self.name


def _ready(case):
    info, config = case
    return ready_with_pending_backward(info, config, growth_interval=5)


def _closure(model, opt, *, overflow=False, touch_params=False):
    def closure(S):
        opt.zero_grad()
        loss = loss_of(model, 7)
        scaledoptim.scale_outputs(loss, S).backward()
        if overflow:
            model[0].bias.grad[0] = float("nan")
        if touch_params:
            with torch.no_grad():
                model[0].weight.add_(1.0)
        return loss

    return closure


def _raising_closure(model, opt):
    def closure(S):
        with torch.no_grad():
            model[2].weight.mul_(3.0)
        raise KeyError("data loader died")

    return closure


def _unscaling_then_raising_closure(model, opt):
    def closure(S):
        _closure(model, opt)(S)
        opt.unscale(grads_scaled_by=S)
        raise KeyError("data loader died")

    return closure


def _set_grad_data(model, value: Callable[[torch.Tensor], torch.Tensor]):
    grad = model[0].bias.grad
    grad.data = value(grad)  # .data bypasses autograd's own dtype/shape checks


def _load_mutated(mutate):
    def call(model, opt):
        state_dict = copy.deepcopy(opt.state_dict())
        mutate(state_dict)
        opt.load_state_dict(state_dict)

    return call


def _meta_param_group(model, opt):
    other = torch.nn.Parameter(torch.zeros(3, device="meta"))
    other.grad = torch.ones(3, device="meta")
    opt.add_param_group({"params": [other]})


def _share_with_another(model, opt):
    scaledoptim.share_scale(opt, scaledoptim.SGD(make_model().parameters(), lr=0.1))


S = "opt.scale"  # the fix every bad scale's message names
BAD = [
    # ---- the scale: wrong types and values
    Bad(
        "scale is a string",
        lambda m, o: o.unscale(grads_scaled_by="65536"),
        TypeError,
        "tensor, a float or None",
    ),
    Bad(
        "scale is a bool",
        lambda m, o: o.unscale_and_step(grads_scaled_by=True),
        TypeError,
        "tensor, a float or None",
    ),
    Bad(
        "scale is an int tensor",
        lambda m, o: o.unscale(grads_scaled_by=torch.tensor(4)),
        TypeError,
        S,
    ),
    Bad("scale is a vector", lambda m, o: o.unscale(grads_scaled_by=torch.ones(2)), TypeError, S),
    Bad("scale is nan", lambda m, o: o.unscale(grads_scaled_by=float("nan")), ValueError, S),
    Bad(
        "scale is inf", lambda m, o: o.unscale_and_step(grads_scaled_by=float("inf")), ValueError, S
    ),
    Bad("scale is negative", lambda m, o: o.unscale(grads_scaled_by=-1.0), ValueError, S),
    Bad("scale is zero", lambda m, o: o.unscale_and_step(grads_scaled_by=0.0), ValueError, S),
    Bad(
        "scale overflows float32",
        lambda m, o: o.unscale(grads_scaled_by=1e300),
        ValueError,
        "in float32",
    ),
    Bad(
        "scale underflows float32",
        lambda m, o: o.unscale(grads_scaled_by=1e-300),
        ValueError,
        "in float32",
    ),
    Bad(
        "scale's reciprocal is inf",
        lambda m, o: o.unscale(grads_scaled_by=1e-45),
        ValueError,
        "reciprocal",
    ),
    Bad(
        "tensor scale is nan",
        lambda m, o: o.unscale(grads_scaled_by=torch.tensor(float("nan"))),
        ValueError,
        S,
    ),
    Bad(
        "float64 tensor scale overflows float32",
        lambda m, o: o.unscale(grads_scaled_by=torch.tensor(1e300, dtype=torch.float64)),
        ValueError,
        "in float32",
    ),
    Bad(
        "scale on another device",
        lambda m, o: o.unscale(grads_scaled_by=torch.ones((), device="meta")),
        RuntimeError,
        "move the scale",
    ),
    Bad(
        "scale passed as the closure",
        lambda m, o: o.unscale_and_step(o.scale),
        TypeError,
        "grads_scaled_by=S",
    ),
    Bad(
        "scale passed as step_after_unscale's closure",
        lambda m, o: o.step_after_unscale(o.scale),
        TypeError,
        "current_grad_scale=S",
        prepare=lambda m, o: o.unscale(grads_scaled_by=o.scale),
    ),
    # ---- configuration
    Bad(
        "process_group of the wrong type",
        lambda m, o: o.configure_scaling(process_group="world"),
        TypeError,
        "dist.group.WORLD",
    ),
    Bad(
        "init_scale is inf",
        lambda m, o: o.configure_scaling(init_scale=float("inf")),
        ValueError,
        "init_scale",
    ),
    Bad(
        "growth_interval is zero",
        lambda m, o: o.configure_scaling(growth_interval=0),
        ValueError,
        "growth_interval",
    ),
    Bad(
        "hysteresis is a float",
        lambda m, o: o.configure_scaling(hysteresis=1.5),
        TypeError,
        "hysteresis",
    ),
    Bad(
        "configure a shared scale",
        lambda m, o: o.configure_scaling(),
        RuntimeError,
        "share_scale",
        prepare=_share_with_another,
    ),
    # ---- closures
    Bad(
        "closure raises",
        lambda m, o: o.unscale_and_step(_raising_closure(m, o), grads_scaled_by=o.scale),
        KeyError,
        "data loader",
    ),
    Bad(
        "closure never becomes finite",
        lambda m, o: o.unscale_and_step(
            _closure(m, o, overflow=True, touch_params=True), grads_scaled_by=o.scale
        ),
        scaledoptim.ClosureReplayError,
        "restored",
    ),
    Bad(
        "closure returns only the loss",
        lambda m, o: o.step_after_unscale(_closure(m, o), current_grad_scale=o.scale),
        TypeError,
        r"\(loss, found_inf, S\)",
    ),
    Bad(
        "closure forgets to unscale",
        lambda m, o: o.step_after_unscale(
            lambda S: (1.0, torch.zeros(()), S), current_grad_scale=o.scale
        ),
        TypeError,
        "must call opt.unscale",
    ),
    Bad(
        "closure unscales, then raises",
        lambda m, o: o.step_after_unscale(
            _unscaling_then_raising_closure(m, o), current_grad_scale=o.scale
        ),
        KeyError,
        "data loader",
    ),
    # ---- grads
    Bad(
        "sparse grad",
        lambda m, o: (
            setattr(m[0].weight, "grad", m[0].weight.grad.to_sparse()),
            o.unscale(grads_scaled_by=o.scale),
        ),
        RuntimeError,
        "dense",
    ),
    Bad(
        "grad on another device",
        lambda m, o: o.unscale_and_step(grads_scaled_by=o.scale),
        RuntimeError,
        "one optimizer per device",
        prepare=_meta_param_group,
    ),
    Bad(
        "integer grad",
        lambda m, o: (
            _set_grad_data(m, lambda g: g.long()),
            o.unscale_and_step(grads_scaled_by=o.scale),
        ),
        TypeError,
        "floating",
    ),
    Bad(
        "grad of the wrong shape",
        lambda m, o: (_set_grad_data(m, lambda g: g[:3]), o.unscale(grads_scaled_by=o.scale)),
        ValueError,
        "shaped like p",
    ),
    # ---- corrupt or mismatched checkpoints
    Bad(
        "checkpoint without a scale",
        _load_mutated(lambda sd: sd["loss_scale"].pop("scale")),
        ValueError,
        "missing",
    ),
    Bad(
        "checkpoint scale out of bounds",
        _load_mutated(lambda sd: sd["loss_scale"].__setitem__("scale", torch.tensor(1e-39))),
        ValueError,
        "outside",
    ),
    Bad(
        "checkpoint scale holds no data",
        _load_mutated(
            lambda sd: sd["loss_scale"].__setitem__("scale", torch.ones((), device="meta"))
        ),
        ValueError,
        "with data",
    ),
    Bad(
        "checkpoint hysteresis beyond config",
        _load_mutated(
            lambda sd: sd["loss_scale"].__setitem__("hysteresis_tracker", torch.tensor(9))
        ),
        ValueError,
        "hysteresis_tracker",
    ),
    Bad(
        "checkpoint growth tracker negative",
        _load_mutated(lambda sd: sd["loss_scale"].__setitem__("growth_tracker", torch.tensor(-1))),
        ValueError,
        "growth_tracker",
    ),
    Bad(
        "checkpoint config of the wrong type",
        _load_mutated(lambda sd: sd["loss_scale"]["config"].__setitem__("growth_interval", "2000")),
        TypeError,
        "growth_interval",
    ),
    Bad(
        "checkpoint of another model",
        _load_mutated(
            lambda sd: sd["state"][0].__setitem__(
                next(k for k in sd["state"][0] if k != "step"), torch.zeros(2)
            )
        ),
        ValueError,
        "another model",
    ),
    Bad(
        "checkpoint missing a param group",
        _load_mutated(lambda sd: sd["param_groups"].pop()),
        ValueError,
        "parameter groups",
    ),
    # ---- calls out of order
    Bad(
        "unscale twice",
        lambda m, o: o.unscale(grads_scaled_by=o.scale),
        RuntimeError,
        "step_after_unscale",
        prepare=lambda m, o: o.unscale(grads_scaled_by=o.scale),
    ),
    Bad(
        "step_after_unscale without unscale",
        lambda m, o: o.step_after_unscale(),
        RuntimeError,
        "call opt.unscale",
    ),
    Bad(
        "step_after_unscale twice",
        lambda m, o: o.step_after_unscale(),
        RuntimeError,
        "call opt.unscale",
        prepare=lambda m, o: (o.unscale(grads_scaled_by=o.scale), o.step_after_unscale()),
    ),
    Bad(
        "state_dict between unscale and step",
        lambda m, o: o.state_dict(),
        RuntimeError,
        "step_after_unscale",
        prepare=lambda m, o: o.unscale(grads_scaled_by=o.scale),
    ),
    Bad(
        "load_state_dict between unscale and step",
        lambda m, o: o.load_state_dict(o.state_dict()),
        RuntimeError,
        "zero_grad",
        prepare=lambda m, o: o.zero_grad() or o.unscale(grads_scaled_by=o.scale),
    ),
    Bad(
        "closure step after unscale",
        lambda m, o: o.unscale_and_step(_closure(m, o), grads_scaled_by=o.scale),
        RuntimeError,
        "Drop the unscale",
        prepare=lambda m, o: o.unscale(grads_scaled_by=o.scale),
    ),
]


@pytest.mark.parametrize("case", OPTIMIZERS)
@pytest.mark.parametrize("bad", BAD, ids=str)
def test_bad_input_raises_naming_the_fix_and_changes_nothing(case, bad: Bad) -> None:
    model, opt = _ready(case)
    bad.prepare(model, opt)
    before = snapshot(opt)
    with pytest.raises(bad.error, match=bad.match):
        bad.call(model, opt)
    assert_bit_identical(before, snapshot(opt))


def test_the_bad_table_is_large_enough() -> None:
    assert len(BAD) + len(LEGAL) >= 25 and len({b.name for b in BAD}) == len(BAD)


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


def closure_returning_none(case):
    model, opt = _ready(case)
    closure = _closure(model, opt)
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
