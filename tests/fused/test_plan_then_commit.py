"""Plan, then commit: every failure a user can provoke surfaces before anything changes.

One row per failure. Each runs on both backends and through every protocol entry point that
the failure applies to, and must (a) raise an error whose message names the problem and the
fix, (b) leave params, optimizer state, grads, the scale, its trackers and the stage
bit-identical, and (c) leave the optimizer usable: once the input is repaired, the same call
steps normally.

Every failure runs on the default config of AdamW and SGD through every entry point; the
failures an optimizer's own code checks (its state, its options) run on the default config of
every other fused row of optim_db too, through ``unscale_and_step`` (the entry points share the
plan, and the engine's checks of params, grads and the environment know no optimizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import rows
from tests.support.training import (
    assert_bit_identical,
    loss_of,
    make_model,
    ready_with_pending_backward,
    snapshot,
)

pytestmark = pytest.mark.usefixtures("kernel_backend")

FORMS = ("unscale_and_step", "unscale", "step_after_unscale")
#: The rows that meet every failure through every form.
EVERY_FORM = ("AdamW", "SGD")
Hook = Callable[[torch.nn.Module, scaledoptim.Optimizer], Any]


@dataclasses.dataclass(frozen=True)
class Failure:
    name: str
    break_it: Hook  # makes the input bad (before the snapshot)
    repair: Hook  # makes it good again
    error: type[BaseException]
    problem: str  # regex: the message names the problem...
    fix: str  # ...and the fix
    forms: tuple[str, ...] = FORMS
    per_optimizer: bool = True  # checked by the optimizer's code (state, options), not the engine's

    def __str__(self) -> str:
        return self.name


def _state_of_first_weight(model, opt) -> dict[str, Any]:
    return opt.state[model[0].weight]


def _state_key(opt) -> str:
    """The optimizer's first state entry (every default config has per-param state)."""
    return next(key for key in opt.state_keys(opt.param_groups[0]) if key is not None)


def _swap_state(value: Callable[[torch.Tensor], Any]) -> tuple[Hook, Hook]:
    saved: dict[str, Any] = {}

    def break_it(model, opt):
        state, key = _state_of_first_weight(model, opt), _state_key(opt)
        saved["value"] = state[key]
        state[key] = value(state[key])

    def repair(model, opt):
        _state_of_first_weight(model, opt)[_state_key(opt)] = saved["value"]

    return break_it, repair


def _swap_step(value: Any) -> tuple[Hook, Hook]:
    saved: dict[str, Any] = {}

    def break_it(model, opt):
        saved["step"] = _state_of_first_weight(model, opt)["step"]
        _state_of_first_weight(model, opt)["step"] = value

    def repair(model, opt):
        _state_of_first_weight(model, opt)["step"] = saved["step"]

    return break_it, repair


def _drop_state_key() -> tuple[Hook, Hook]:
    saved: dict[str, Any] = {}

    def break_it(model, opt):
        state = _state_of_first_weight(model, opt)
        key = _state_key(opt)
        saved["value"] = state.pop(key)
        state["unrelated"] = torch.zeros(1)  # not a fresh state: the missing entry is corruption

    def repair(model, opt):
        state = _state_of_first_weight(model, opt)
        state.pop("unrelated")
        state[_state_key(opt)] = saved["value"]

    return break_it, repair


def _swap_group(key: str, value: Any) -> tuple[Hook, Hook]:
    saved: dict[str, Any] = {}

    def break_it(model, opt):
        group = opt.param_groups[0]
        saved["value"] = group[key]
        if value is _DELETE:
            del group[key]
        else:
            group[key] = value

    def repair(model, opt):
        opt.param_groups[0][key] = saved["value"]

    return break_it, repair


def _swap_grad(
    value: Callable[[torch.Tensor], torch.Tensor], *, via_data: bool = False
) -> tuple[Hook, Hook]:
    saved: dict[str, Any] = {}

    def break_it(model, opt):
        param = model[0].weight
        saved["grad"] = param.grad
        if via_data:  # .data bypasses autograd's own dtype/shape checks
            param.grad = param.grad.clone()
            param.grad.data = value(param.grad)
        else:
            param.grad = value(param.grad)

    def repair(model, opt):
        model[0].weight.grad = saved["grad"]

    return break_it, repair


def _extra_param(make: Callable[[], torch.nn.Parameter]) -> tuple[Hook, Hook]:
    def break_it(model, opt):
        opt.add_param_group({"params": [make()]})

    def repair(model, opt):
        opt.param_groups.pop()

    return break_it, repair


def _env(value: str) -> tuple[Hook, Hook]:
    import os

    saved: dict[str, Any] = {}

    def break_it(model, opt):
        saved["value"] = os.environ.get("SCALEDOPTIM_KERNELS")
        os.environ["SCALEDOPTIM_KERNELS"] = value

    def repair(model, opt):
        if saved["value"] is None:
            del os.environ["SCALEDOPTIM_KERNELS"]
        else:
            os.environ["SCALEDOPTIM_KERNELS"] = saved["value"]

    return break_it, repair


def _meta_param() -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(3, device="meta"))
    param.grad = torch.ones(3, device="meta")
    return param


_DELETE = object()
CLEAR_STATE = r"opt\.state\[p\]\.clear\(\)"
FAILURES = [
    Failure(
        "state of the wrong size",
        *_swap_state(lambda t: torch.zeros(4)),
        ValueError,
        r"shape \(4,\).*param.*shape \(17, 6\)",
        CLEAR_STATE,
    ),
    Failure(
        "state of the right size but the wrong shape",
        *_swap_state(lambda t: t.reshape(6, 17).clone()),
        ValueError,
        r"shape \(6, 17\)",
        CLEAR_STATE,
    ),
    Failure(
        "state entry that is not a tensor",
        *_swap_state(lambda t: 3.0),
        TypeError,
        "is a float, not a tensor",
        CLEAR_STATE,
    ),
    Failure(
        "integer state tensor",
        *_swap_state(lambda t: t.long()),
        ValueError,
        "torch.int64 tensor",
        CLEAR_STATE,
    ),
    Failure(
        "state on another device",
        *_swap_state(lambda t: t.to("meta")),
        RuntimeError,
        "is on meta but its param is on cpu",
        "load_state_dict",
    ),
    Failure(
        "state entry missing", *_drop_state_key(), ValueError, "but no '{state_key}'", CLEAR_STATE
    ),
    Failure(
        "step counter of the wrong type",
        *_swap_step("seven"),
        TypeError,
        "'step'.*'seven'",
        CLEAR_STATE,
    ),
    Failure(
        "param group missing a key",
        *_swap_group("lr", _DELETE),
        ValueError,
        r"param_groups\[0\] has no \['lr'\]",
        "add_param_group",
    ),
    Failure(
        "negative learning rate in a group",
        *_swap_group("lr", -0.1),
        ValueError,
        "Invalid learning rate: -0.1",
        "Invalid",
    ),
    Failure(
        "lr tensor of several elements in a group",
        *_swap_group("lr", torch.tensor([0.1, 0.2])),
        ValueError,
        "Tensor lr must be 1-element",
        "1-element",
        per_optimizer=False,
    ),
    Failure(
        "param on another device",
        *_extra_param(_meta_param),
        RuntimeError,
        "is on meta but the loss scale is on cpu",
        "one optimizer per device",
        per_optimizer=False,
    ),
    Failure(
        "sparse grad",
        *_swap_grad(lambda g: g.to_sparse()),
        RuntimeError,
        "sparse gradients",
        r"nn\.Embedding\(sparse=False\)",
        per_optimizer=False,
    ),
    Failure(
        "integer grad",
        *_swap_grad(lambda g: g.long(), via_data=True),
        TypeError,
        "dtype torch.int64",
        "Assign p.grad a floating tensor",
        per_optimizer=False,
    ),
    Failure(
        "grad of the wrong shape",
        *_swap_grad(lambda g: g[:3], via_data=True),
        ValueError,
        r"shape \(3, 6\)",
        "shaped like p",
        per_optimizer=False,
    ),
    Failure(
        "unknown SCALEDOPTIM_KERNELS",
        *_env("gpu"),
        ValueError,
        "SCALEDOPTIM_KERNELS='gpu'",
        "or leave it unset",
        per_optimizer=False,
    ),
]


def _ready(info):
    return ready_with_pending_backward(info, growth_interval=3)


def _everything(model, opt) -> tuple[list[torch.Tensor], Any]:
    grads = [
        p.grad.detach().clone()
        for g in opt.param_groups
        for p in g["params"]
        if p.grad is not None and not p.is_meta and not p.grad.is_sparse
    ]
    return [t for t in snapshot(opt) if not t.is_meta] + grads, opt.scaling_state.unscaled


def _call(form: str, opt) -> None:
    if form == "unscale_and_step":
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    elif form == "unscale":
        opt.unscale(grads_scaled_by=opt.scale)
    else:
        opt.step_after_unscale()


def test_the_failure_table_is_large_enough() -> None:
    assert len(FAILURES) >= 15 and len({f.name for f in FAILURES}) == len(FAILURES)


CASES = [
    pytest.param(info, form, failure, id=f"{failure}-{info.name}-{form}")
    for failure in FAILURES
    for info in rows(fused=True)
    for form in FORMS
    if info.name in EVERY_FORM or (form == "unscale_and_step" and failure.per_optimizer)
]


@pytest.mark.parametrize(("info", "form", "failure"), CASES)
def test_a_failure_changes_nothing_and_names_the_fix(info, form, failure: Failure) -> None:
    model, opt = _ready(info)
    if form == "step_after_unscale":
        opt.unscale(grads_scaled_by=opt.scale)
    failure.break_it(model, opt)
    tensors, stage = _everything(model, opt)
    problem = failure.problem.replace("{state_key}", _state_key(opt))
    try:
        with pytest.raises(failure.error, match=problem) as raised:
            _call(form, opt)
        assert _fix_named(failure.fix, str(raised.value)), f"no fix in: {raised.value}"
        after, after_stage = _everything(model, opt)
        assert_bit_identical(tensors, after)
        assert after_stage is stage
    finally:
        failure.repair(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    _call(form, opt)  # usable again: the same call now works
    if form == "unscale":
        opt.step_after_unscale()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _fix_named(fix: str, message: str) -> bool:
    import re

    return re.search(fix, message) is not None


def test_lbfgs_without_a_closure_is_refused_before_anything_changes() -> None:
    model = make_model()
    opt = scaledoptim.LBFGS(model.parameters(), lr=0.5)
    scaledoptim.scale_outputs(loss_of(model, 0), opt.scale).backward()
    tensors, stage = _everything(model, opt)
    for call in (lambda: opt.unscale_and_step(grads_scaled_by=opt.scale),):
        with pytest.raises(RuntimeError, match=r"needs one: opt\.unscale_and_step\(closure"):
            call()
        after, after_stage = _everything(model, opt)
        assert_bit_identical(tensors, after)
        assert after_stage is stage
