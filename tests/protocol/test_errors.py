"""Bad input raises a clear error naming the fix, and leaves params, state and scale bit-identical.

The bad calls run the default config of every row whose ``step()`` takes no closure (the
protocol's checks do not branch on the update's options); every row's error inputs are refused
by its constructor.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import optim_db, row, rows
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _trained(info):
    model = make_model()
    opt = info.make(model.parameters())
    for step in range(2):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, 2), opt.scale).backward()
    return model, opt


def _sparse_grad(model, opt):
    # SGD and Adagrad take sparse grads, as torch.optim's, but not with weight decay.
    opt.param_groups[0]["weight_decay"] = opt.param_groups[0]["weight_decay"] or 0.1
    model[0].weight.grad = model[0].weight.grad.to_sparse()


BAD_CALLS = [
    (
        "zero scale",
        lambda m, o: o.unscale_and_step(grads_scaled_by=0.0),
        ValueError,
        "finite and > 0",
    ),
    ("negative scale", lambda m, o: o.unscale(grads_scaled_by=-2.0), ValueError, "finite and > 0"),
    (
        "nan scale",
        lambda m, o: o.unscale(grads_scaled_by=float("nan")),
        ValueError,
        "finite and > 0",
    ),
    (
        "inf tensor scale",
        lambda m, o: o.unscale_and_step(grads_scaled_by=torch.tensor(float("inf"))),
        ValueError,
        "opt.scale",
    ),
    (
        "negative tensor scale",
        lambda m, o: o.unscale(grads_scaled_by=torch.tensor(-1.0)),
        ValueError,
        "finite and > 0",
    ),
    (
        "scale of wrong type",
        lambda m, o: o.unscale(grads_scaled_by="65536"),
        TypeError,
        "tensor, a float or None",
    ),
    (
        "vector scale",
        lambda m, o: o.unscale(grads_scaled_by=torch.ones(2)),
        TypeError,
        "one-element",
    ),
    (
        "scale on other device",
        lambda m, o: o.unscale(grads_scaled_by=torch.ones((), device="meta")),
        RuntimeError,
        "move the scale",
    ),
    (
        "unscale twice",
        lambda m, o: (o.unscale(grads_scaled_by=o.scale), o.unscale(grads_scaled_by=o.scale)),
        RuntimeError,
        "step_after_unscale",
    ),
    (
        "step_after_unscale without unscale",
        lambda m, o: o.step_after_unscale(),
        RuntimeError,
        "call opt.unscale",
    ),
    (
        "sparse grads with weight decay",
        lambda m, o: (_sparse_grad(m, o), o.unscale_and_step(grads_scaled_by=o.scale)),
        RuntimeError,
        "sparse",
    ),
    (
        "closure returning the wrong shape",
        lambda m, o: o.step_after_unscale(lambda S: 1.0, current_grad_scale=o.scale),
        TypeError,
        r"\(loss, found_inf, S\)",
    ),
]


@pytest.mark.parametrize("info", rows(closure=False), ids=str)
@pytest.mark.parametrize("bad_call", BAD_CALLS, ids=lambda b: b[0])
def test_bad_input_raises_and_changes_nothing(info, bad_call) -> None:
    _, call, error, message = bad_call
    model, opt = _trained(info)
    if bad_call[0] == "unscale twice":
        opt.unscale(grads_scaled_by=opt.scale)
        before = snapshot(opt)
        with pytest.raises(error, match=message):
            opt.unscale(grads_scaled_by=opt.scale)
    else:
        before = snapshot(opt)
        with pytest.raises(error, match=message):
            call(model, opt)
    assert_bit_identical(before, snapshot(opt))


def test_grads_on_two_devices_are_rejected_before_anything_changes() -> None:
    _, opt = _trained(row("AdamW"))
    other = torch.nn.Parameter(torch.zeros(3, device="meta"))
    other.grad = torch.ones(3, device="meta")
    opt.add_param_group({"params": [other]})
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="one optimizer per device"):
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert_bit_identical(before, snapshot(opt))


def test_zero_grad_forgets_an_unconsumed_unscale() -> None:
    model, opt = _trained(row("AdamW"))
    opt.unscale(grads_scaled_by=opt.scale)
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, 3), opt.scale).backward()
    opt.unscale(grads_scaled_by=opt.scale)  # no error: new grads
    opt.step_after_unscale()


@pytest.mark.parametrize(
    ("info", "error_input"),
    [
        pytest.param(info, e, id=f"{info.name}-{e.name}")
        for info in optim_db
        for e in info.error_inputs
    ],
)
def test_every_rows_error_inputs_are_refused(info, error_input) -> None:
    with pytest.raises(error_input.error, match=error_input.match):
        info.cls(make_model().parameters(), **error_input.kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(1.0, 0.9)), "beta"),
        (dict(eps=-1.0), "epsilon"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        scaledoptim.AdamW(make_model().parameters(), **kwargs)


def test_sgd_nesterov_needs_momentum() -> None:
    with pytest.raises(ValueError, match="Nesterov"):
        scaledoptim.SGD(make_model().parameters(), lr=0.1, nesterov=True)
