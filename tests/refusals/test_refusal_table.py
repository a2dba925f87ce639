"""The refusal table: every public entry point x each bad input -> the exception type, the words a
user needs (the problem and the fix), and nothing changed (params, grads, state, scale), checked
by one helper (tests/support/refusal.py).

Each row runs on an Adam-family and an SGD optimizer, two steps in with a scaled backward pending
(the protocol's checks do not branch on the update), one on our kernels in the emulator and one
on the torch forms; a row the optimizer's own code checks (its state, its options) runs on every
fused row of optim_db, on alternating backends. The constructors' refusals are every row's error
inputs; torch's own error inputs run in tests/optim/test_torch_optim_db.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import OptimInfo, optim_db, row, rows
from tests.support.references import kernels_mode
from tests.support.refusal import NOOP, Hook, Refusal, assert_refused
from tests.support.training import (
    loss_of,
    make_model,
    ready_with_pending_backward,
    scaled_closure,
)

# ----------------------------------------------------------------------------- bad inputs
_saved: dict[str, Any] = {}


def _swap(get: Callable[[Any, Any], tuple[dict, str]], value: Callable[[Any], Any]
          ) -> tuple[Hook, Hook]:
    """Hooks that replace ``container[key]`` by ``value(old)`` (``_DELETE``: drop it) and put
    the old value back."""

    def break_it(model, opt):
        container, key = get(model, opt)
        _saved[key] = container[key]
        new = value(container[key])
        if new is _DELETE:
            del container[key]
        else:
            container[key] = new

    def repair(model, opt):
        container, key = get(model, opt)
        container[key] = _saved.pop(key)

    return break_it, repair


_DELETE = object()


def _state_key(opt) -> str:
    return next(key for key in opt.state_keys(opt.param_groups[0]) if key is not None)


def _first_state(model, opt):
    return opt.state[model[0].weight], _state_key(opt)


def _first_step(model, opt):
    return opt.state[model[0].weight], "step"


def _first_group(key: str):
    return lambda model, opt: (opt.param_groups[0], key)


def _grad_data(value: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Hook, Hook]:
    """``.data`` of the first weight's grad replaced (bypassing autograd's own checks)."""

    def break_it(model, opt):
        param = model[0].weight
        _saved["grad"] = param.grad
        param.grad = param.grad.clone()
        param.grad.data = value(param.grad)

    def repair(model, opt):
        model[0].weight.grad = _saved.pop("grad")

    return break_it, repair


def _sparse_grad() -> tuple[Hook, Hook]:
    def break_it(model, opt):
        param = model[0].weight
        _saved["grad"] = param.grad
        param.grad = param.grad.to_sparse()

    def repair(model, opt):
        model[0].weight.grad = _saved.pop("grad")

    return break_it, repair


def _meta_param_group() -> tuple[Hook, Hook]:
    def break_it(model, opt):
        other = torch.nn.Parameter(torch.zeros(3, device="meta"))
        other.grad = torch.ones(3, device="meta")
        opt.add_param_group({"params": [other]})

    def repair(model, opt):
        opt.param_groups.pop()

    return break_it, repair


def _env(value: str) -> tuple[Hook, Hook]:
    import os

    def break_it(model, opt):
        _saved["env"] = os.environ.get("SCALEDOPTIM_KERNELS")
        os.environ["SCALEDOPTIM_KERNELS"] = value

    def repair(model, opt):
        saved = _saved.pop("env")
        if saved is None:
            del os.environ["SCALEDOPTIM_KERNELS"]
        else:
            os.environ["SCALEDOPTIM_KERNELS"] = saved

    return break_it, repair


def _drop_state_entry() -> tuple[Hook, Hook]:
    def break_it(model, opt):
        state, key = _first_state(model, opt)
        _saved["entries"] = dict(state)
        state.pop(key)
        state["unrelated"] = torch.zeros(1)  # not a fresh state: the missing entry is corruption

    def repair(model, opt):
        state = opt.state[model[0].weight]
        state.clear()
        state.update(_saved.pop("entries"))  # in their order

    return break_it, repair


#: What each form of the step calls (a pending unscale first for step_after_unscale).
FORMS: dict[str, tuple[Hook, Hook]] = {
    "unscale_and_step": (NOOP, lambda m, o: o.unscale_and_step(grads_scaled_by=o.scale)),
    "unscale": (NOOP, lambda m, o: o.unscale(grads_scaled_by=o.scale)),
    "step_after_unscale": (lambda m, o: o.unscale(grads_scaled_by=o.scale),
                           lambda m, o: o.step_after_unscale()),
}
CLEAR_STATE = r"opt\.state\[p\]\.clear\(\)"
#: Inputs a step finds bad while planning: (bad, (break, repair), error, words, every optimizer).
PLANNED = [
    ("state of the wrong size", _swap(_first_state, lambda t: torch.zeros(4)), ValueError,
     (r"shape \(4,\).*param.*shape \(17, 6\)", CLEAR_STATE), True),
    ("state of the right size but the wrong shape",
     _swap(_first_state, lambda t: t.reshape(6, 17).clone()), ValueError,
     (r"shape \(6, 17\)", CLEAR_STATE), True),
    ("state entry that is not a tensor", _swap(_first_state, lambda t: 3.0), TypeError,
     ("is a float, not a tensor", CLEAR_STATE), True),
    ("integer state tensor", _swap(_first_state, lambda t: t.long()), ValueError,
     ("torch.int64 tensor", CLEAR_STATE), True),
    ("state on another device", _swap(_first_state, lambda t: t.to("meta")), RuntimeError,
     ("is on meta but its param is on cpu", "load_state_dict"), True),
    ("state entry missing", _drop_state_entry(), ValueError, ("but no '", CLEAR_STATE), True),
    ("step counter of the wrong type", _swap(_first_step, lambda t: "seven"), TypeError,
     ("'step'.*'seven'", CLEAR_STATE), True),
    ("param group missing a key", _swap(_first_group("lr"), lambda v: _DELETE), ValueError,
     (r"param_groups\[0\] has no \['lr'\]", "add_param_group"), True),
    ("negative learning rate in a group", _swap(_first_group("lr"), lambda v: -0.1), ValueError,
     ("Invalid learning rate: -0.1",), True),
    ("lr tensor of several elements in a group",
     _swap(_first_group("lr"), lambda v: torch.tensor([0.1, 0.2])), ValueError,
     ("Tensor lr must be 1-element",), False),
    ("param on another device", _meta_param_group(), RuntimeError,
     ("is on meta but the loss scale is on cpu", "one optimizer per device"), False),
    ("sparse grad", _sparse_grad(), RuntimeError,
     ("sparse gradients", r"nn\.Embedding\(sparse=False\)"), False),
    ("integer grad", _grad_data(lambda g: g.long()), TypeError,
     ("dtype torch.int64", "Assign p.grad a floating tensor"), False),
    ("grad of the wrong shape", _grad_data(lambda g: g[:3]), ValueError,
     (r"shape \(3, 6\)", "shaped like p"), False),
    ("unknown SCALEDOPTIM_KERNELS", _env("gpu"), ValueError,
     ("SCALEDOPTIM_KERNELS='gpu'", "or leave it unset"), False),
]


def _planned(form: str, bad: str, hooks: tuple[Hook, Hook], error, words, every) -> Refusal:
    (prepare, step), (break_it, repair) = FORMS[form], hooks

    def call(model, opt):
        break_it(model, opt)
        step(model, opt)

    return Refusal(form, bad, call, error, words, prepare=prepare, repair=repair, again=step,
                   every_optimizer=every)


# ------------------------------------------------------------------------- the other rows


def _raising_closure(model, opt):
    def closure(S):
        with torch.no_grad():
            model[2].weight.mul_(3.0)
        raise KeyError("data loader died")

    return closure


def _unscaling_then_raising_closure(model, opt):
    def closure(S):
        scaled_closure(model, opt)(S)
        opt.unscale(grads_scaled_by=S)
        raise KeyError("data loader died")

    return closure


def _load_mutated(mutate):
    def call(model, opt):
        state_dict = copy.deepcopy(opt.state_dict())
        mutate(state_dict)
        opt.load_state_dict(state_dict)

    return call


def _loss_scale(key: str, value: Any):
    return _load_mutated(lambda sd: sd["loss_scale"].__setitem__(key, value))


def _share_with_another(model, opt):
    scaledoptim.share_scale(opt, scaledoptim.SGD(make_model().parameters(), lr=0.1))


def _pending_unscale(model, opt):
    opt.unscale(grads_scaled_by=opt.scale)


S = "opt.scale"  # the fix every bad scale's message names
UNSCALE, BOTH = "unscale", "unscale_and_step"
REFUSALS: list[Refusal] = [
    # ---- the scale: wrong types and values
    Refusal(UNSCALE, "scale is a string", lambda m, o: o.unscale(grads_scaled_by="65536"),
            TypeError, ("tensor, a float or None",)),
    Refusal(BOTH, "scale is a bool", lambda m, o: o.unscale_and_step(grads_scaled_by=True),
            TypeError, ("tensor, a float or None",)),
    Refusal(UNSCALE, "scale is an int tensor",
            lambda m, o: o.unscale(grads_scaled_by=torch.tensor(4)), TypeError, (S,)),
    Refusal(UNSCALE, "scale is a vector", lambda m, o: o.unscale(grads_scaled_by=torch.ones(2)),
            TypeError, ("one-element", S)),
    Refusal(UNSCALE, "scale is nan", lambda m, o: o.unscale(grads_scaled_by=float("nan")),
            ValueError, ("finite and > 0", S)),
    Refusal(BOTH, "scale is inf", lambda m, o: o.unscale_and_step(grads_scaled_by=float("inf")),
            ValueError, (S,)),
    Refusal(UNSCALE, "scale is negative", lambda m, o: o.unscale(grads_scaled_by=-1.0),
            ValueError, ("finite and > 0", S)),
    Refusal(BOTH, "scale is zero", lambda m, o: o.unscale_and_step(grads_scaled_by=0.0),
            ValueError, ("finite and > 0", S)),
    Refusal(UNSCALE, "scale overflows float32", lambda m, o: o.unscale(grads_scaled_by=1e300),
            ValueError, ("in float32",)),
    Refusal(UNSCALE, "scale underflows float32", lambda m, o: o.unscale(grads_scaled_by=1e-300),
            ValueError, ("in float32",)),
    Refusal(UNSCALE, "scale's reciprocal is inf", lambda m, o: o.unscale(grads_scaled_by=1e-45),
            ValueError, ("reciprocal",)),
    Refusal(UNSCALE, "tensor scale is nan",
            lambda m, o: o.unscale(grads_scaled_by=torch.tensor(float("nan"))), ValueError, (S,)),
    Refusal(BOTH, "tensor scale is inf",
            lambda m, o: o.unscale_and_step(grads_scaled_by=torch.tensor(float("inf"))),
            ValueError, (S,)),
    Refusal(UNSCALE, "tensor scale is negative",
            lambda m, o: o.unscale(grads_scaled_by=torch.tensor(-1.0)), ValueError,
            ("finite and > 0",)),
    Refusal(UNSCALE, "float64 tensor scale overflows float32",
            lambda m, o: o.unscale(grads_scaled_by=torch.tensor(1e300, dtype=torch.float64)),
            ValueError, ("in float32",)),
    Refusal(UNSCALE, "scale on another device",
            lambda m, o: o.unscale(grads_scaled_by=torch.ones((), device="meta")), RuntimeError,
            ("move the scale",)),
    Refusal(BOTH, "scale passed as the closure", lambda m, o: o.unscale_and_step(o.scale),
            TypeError, ("grads_scaled_by=S",)),
    Refusal("step_after_unscale", "scale passed as its closure",
            lambda m, o: o.step_after_unscale(o.scale), TypeError, ("current_grad_scale=S",),
            prepare=_pending_unscale),
    # ---- configuration
    Refusal("configure_scaling", "process_group of the wrong type",
            lambda m, o: o.configure_scaling(process_group="world"), TypeError,
            ("dist.group.WORLD",)),
    Refusal("configure_scaling", "init_scale is inf",
            lambda m, o: o.configure_scaling(init_scale=float("inf")), ValueError,
            ("init_scale",)),
    Refusal("configure_scaling", "growth_interval is zero",
            lambda m, o: o.configure_scaling(growth_interval=0), ValueError,
            ("growth_interval",)),
    Refusal("configure_scaling", "hysteresis is a float",
            lambda m, o: o.configure_scaling(hysteresis=1.5), TypeError, ("hysteresis",)),
    Refusal("configure_scaling", "a shared scale", lambda m, o: o.configure_scaling(),
            RuntimeError, ("share_scale",), prepare=_share_with_another),
    # ---- closures (which compute new grads: only params, state and scale are kept)
    Refusal(BOTH, "closure raises",
            lambda m, o: o.unscale_and_step(_raising_closure(m, o), grads_scaled_by=o.scale),
            KeyError, ("data loader",), grads_kept=False),
    Refusal(BOTH, "closure never becomes finite",
            lambda m, o: o.unscale_and_step(scaled_closure(m, o, overflow=True, touch_params=True),
                                            grads_scaled_by=o.scale),
            scaledoptim.ClosureReplayError, ("restored",), grads_kept=False),
    Refusal("step_after_unscale", "closure returns only the loss",
            lambda m, o: o.step_after_unscale(scaled_closure(m, o), current_grad_scale=o.scale),
            TypeError, (r"\(loss, found_inf, S\)",), grads_kept=False),
    Refusal("step_after_unscale", "closure forgets to unscale",
            lambda m, o: o.step_after_unscale(lambda S: (1.0, torch.zeros(()), S),
                                              current_grad_scale=o.scale),
            TypeError, ("must call opt.unscale",), grads_kept=False),
    Refusal("step_after_unscale", "closure unscales, then raises",
            lambda m, o: o.step_after_unscale(_unscaling_then_raising_closure(m, o),
                                              current_grad_scale=o.scale),
            KeyError, ("data loader",), grads_kept=False),
    Refusal(BOTH, "closure step after unscale",
            lambda m, o: o.unscale_and_step(scaled_closure(m, o), grads_scaled_by=o.scale),
            RuntimeError, ("Drop the unscale",), prepare=_pending_unscale, grads_kept=False),
    # ---- corrupt or mismatched checkpoints
    Refusal("load_state_dict", "no scale",
            _load_mutated(lambda sd: sd["loss_scale"].pop("scale")), ValueError, ("missing",)),
    Refusal("load_state_dict", "scale out of bounds", _loss_scale("scale", torch.tensor(1e-39)),
            ValueError, ("outside",)),
    Refusal("load_state_dict", "scale holds no data",
            _loss_scale("scale", torch.ones((), device="meta")), ValueError, ("with data",)),
    Refusal("load_state_dict", "hysteresis beyond the config",
            _loss_scale("hysteresis_tracker", torch.tensor(9)), ValueError,
            ("hysteresis_tracker",)),
    Refusal("load_state_dict", "negative growth tracker",
            _loss_scale("growth_tracker", torch.tensor(-1)), ValueError, ("growth_tracker",)),
    Refusal("load_state_dict", "negative hysteresis tracker",
            _loss_scale("hysteresis_tracker", torch.tensor(-1)), ValueError,
            ("hysteresis_tracker",)),
    Refusal("load_state_dict", "config of the wrong type",
            _load_mutated(lambda sd: sd["loss_scale"]["config"].__setitem__(
                "growth_interval", "2000")),
            TypeError, ("growth_interval",)),
    Refusal("load_state_dict", "a negative step count",
            _load_mutated(lambda sd: sd["state"][0].__setitem__("step", -3.0)), ValueError,
            ("'step'", "finite count of steps")),
    Refusal("load_state_dict", "state of another model",
            _load_mutated(lambda sd: sd["state"][0].__setitem__(
                next(k for k in sd["state"][0] if k != "step"), torch.zeros(2))),
            ValueError, ("another model",), every_optimizer=True),
    Refusal("load_state_dict", "negative scale", _loss_scale("scale", torch.tensor(-1.0)),
            ValueError, ("scale",)),
    Refusal("load_state_dict", "nan scale", _loss_scale("scale", torch.tensor(float("nan"))),
            ValueError, ("scale",)),
    Refusal("load_state_dict", "a scale that is no tensor", _loss_scale("scale", "big"),
            ValueError, ("one-element tensor",)),
    Refusal("load_state_dict", "a growth factor below 1",
            _load_mutated(lambda sd: sd["loss_scale"]["config"].__setitem__("growth_factor", 0.5)),
            ValueError, ("growth_factor",)),
    Refusal("load_state_dict", "an unknown config key",
            _load_mutated(lambda sd: sd["loss_scale"]["config"].__setitem__("bogus", 1)),
            ValueError, ("unknown config",)),
    Refusal("load_state_dict", "a loss_scale that is no dict",
            _load_mutated(lambda sd: sd.__setitem__("loss_scale", 3)), TypeError,
            ("must be a dict",)),
    Refusal("load_state_dict", "a param group missing",
            _load_mutated(lambda sd: sd["param_groups"].pop()), ValueError,
            ("parameter groups",)),
    # ---- calls out of order
    Refusal(UNSCALE, "unscale twice", lambda m, o: o.unscale(grads_scaled_by=o.scale),
            RuntimeError, ("step_after_unscale",), prepare=_pending_unscale),
    Refusal("step_after_unscale", "without unscale", lambda m, o: o.step_after_unscale(),
            RuntimeError, ("call opt.unscale",)),
    Refusal("step_after_unscale", "twice", lambda m, o: o.step_after_unscale(), RuntimeError,
            ("call opt.unscale",),
            prepare=lambda m, o: (o.unscale(grads_scaled_by=o.scale), o.step_after_unscale())),
    Refusal("state_dict", "between unscale and step", lambda m, o: o.state_dict(), RuntimeError,
            ("step_after_unscale",), prepare=_pending_unscale),
    Refusal("load_state_dict", "between unscale and step",
            lambda m, o: o.load_state_dict(o.state_dict()), RuntimeError, ("zero_grad",),
            prepare=lambda m, o: o.zero_grad() or o.unscale(grads_scaled_by=o.scale)),
    # ---- the plan's checks, through every form of the step
    *(_planned(form, *planned) for planned in PLANNED for form in FORMS),
]


def _optimizers(refusal: Refusal) -> list[tuple[OptimInfo, Any, str]]:
    """(row, config, backend): an Adam and an SGD, or every fused row, on alternating backends."""
    if refusal.every_optimizer:
        chosen = [(info, info.default) for info in rows(fused=True)]
    else:
        chosen = [(row("AdamW"), row("AdamW").default), (row("SGD"), row("SGD").config(
            "momentum-wd"))]
    return [(info, config, ("emulate", "torch")[i % 2]) for i, (info, config) in
            enumerate(chosen)]


def test_the_table_is_large_and_says_what_each_row_is() -> None:
    names = [str(refusal) for refusal in REFUSALS]
    assert len(names) >= 80 and len(set(names)) == len(names)
    assert {r.entry for r in REFUSALS} >= {
        "unscale", "unscale_and_step", "step_after_unscale", "configure_scaling",
        "load_state_dict", "state_dict",
    }


@pytest.mark.parametrize("refusal", REFUSALS, ids=str)
def test_a_bad_input_is_refused_with_the_fix_and_changes_nothing(refusal: Refusal) -> None:
    for info, config, backend in _optimizers(refusal):
        with kernels_mode(backend):
            model, opt = ready_with_pending_backward(info, config, growth_interval=3)
            assert_refused(refusal, model, opt, f"{info.name} on {backend}")


@pytest.mark.parametrize(
    ("info", "error_input"),
    [pytest.param(info, e, id=f"{info.name}-{e.name}") for info in optim_db
     for e in info.error_inputs],
)
def test_a_constructor_refuses_its_rows_error_inputs(info: OptimInfo, error_input) -> None:
    with pytest.raises(error_input.error, match=error_input.match):
        info.cls(make_model().parameters(), **error_input.kwargs)


def test_lbfgs_without_a_closure_is_refused_before_anything_changes() -> None:
    model = make_model()
    opt = scaledoptim.LBFGS(model.parameters(), lr=0.5)
    scaledoptim.scale_outputs(loss_of(model, 0), opt.scale).backward()
    refusal = Refusal(BOTH, "no closure for LBFGS",
                      lambda m, o: o.unscale_and_step(grads_scaled_by=o.scale), RuntimeError,
                      (r"needs one: opt\.unscale_and_step\(closure",))
    assert_refused(refusal, model, opt)
