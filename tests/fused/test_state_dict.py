"""state_dict round trips: resuming is bit-identical, torch.optim state_dicts load, corrupt
ones don't.

Resuming runs every generic config of every fused row; loading torch.optim's state_dict, every
generic config of the rows with a torch.optim reference.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import rows
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _configs(selected):
    return [
        pytest.param(info, config, id=f"{info.name}-{config.name}")
        for info in selected
        for config in info.generic_configs
    ]


OVERFLOWS = {2, 5, 6}


def _train(model, opt, steps):
    S = opt.scale
    for step in steps:
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), S).backward()
        if step in OVERFLOWS:
            model[2].bias.grad[0] = float("inf")
        _, _, S = opt.unscale_and_step(grads_scaled_by=S)


def _resume_is_bit_identical(info, config, dtype, **changes) -> None:
    """Checkpoint mid growth interval and mid hysteresis, through torch.save/torch.load."""

    def fresh():
        model = make_model(dtype)
        opt = info.make(model.parameters(), config, **changes)
        return model, opt.configure_scaling(init_scale=2.0**8, growth_interval=3, hysteresis=2)

    model, opt = fresh()
    _train(model, opt, range(6))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    _train(model, opt, range(6, 12))

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed_model, resumed_opt = fresh()
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert resumed_opt.scaling_state.loss_scale.hysteresis_tracker.item() == 1, "mid hysteresis"
    _train(resumed_model, resumed_opt, range(6, 12))
    assert_bit_identical(snapshot(opt), snapshot(resumed_opt))


@pytest.mark.parametrize(("info", "config"), _configs(rows(fused=True)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_checkpoint_is_bit_identical(info, config, dtype) -> None:
    _resume_is_bit_identical(info, config, dtype)


@pytest.mark.parametrize("info", rows(fused=True, rounding=True), ids=str)
@pytest.mark.parametrize("rounding", ["master_weights", "stochastic_rounding"])
def test_resume_with_a_rounding_option_is_bit_identical(info, rounding) -> None:
    """bf16 params with fp32 masters or seeded stochastic rounding (the row's default config)."""
    _resume_is_bit_identical(info, info.default, torch.bfloat16, **{rounding: True})


@pytest.mark.parametrize(("info", "config"), _configs(rows(fused=True, reference=True)))
def test_plain_torch_state_dict_loads_with_default_scale(info, config) -> None:
    ref_model, model = make_model(), make_model()
    ref_opt = info.reference_for(ref_model.parameters(), config)
    for step in range(3):
        ref_opt.zero_grad()
        loss_of(ref_model, step).backward()
        ref_opt.step()
    model.load_state_dict(ref_model.state_dict())
    opt = info.make(model.parameters(), config).configure_scaling(init_scale=512.0)
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.scale.item() == 512.0
    for step in range(3, 6):
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, step).backward()
            o.step()
    tolerance = info.tolerance
    for ref_p, p in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(
            p, ref_p, rtol=tolerance.trajectory_rtol, atol=tolerance.trajectory_atol
        )


def test_bf16_state_stays_fp32_through_a_load() -> None:
    model = make_model(torch.bfloat16)
    opt = scaledoptim.AdamW(model.parameters())
    _train(model, opt, range(2))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


@pytest.mark.parametrize("name", ["LAMB", "Lion"])
def test_a_load_adds_no_option_the_optimizer_lacks(name) -> None:
    # torch.optim's __setstate__ gives every optimizer's defaults a `differentiable`, which LAMB
    # and Lion do not have; their groups would gain it (a DCP resume's groups then differ).
    model = make_model()
    opt = getattr(scaledoptim, name)(model.parameters())
    _train(model, opt, range(2))
    keys = set(opt.defaults), [set(group) for group in opt.param_groups]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert (set(opt.defaults), [set(group) for group in opt.param_groups]) == keys
    copied = copy.deepcopy(opt)
    assert (set(copied.defaults), [set(group) for group in copied.param_groups]) == keys


def _corrupt(mutate):
    model = make_model()
    opt = scaledoptim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, range(3))
    state_dict = copy.deepcopy(opt.state_dict())
    mutate(state_dict)
    return opt, state_dict


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda sd: sd["loss_scale"].pop("scale"), ValueError, "missing"),
        (lambda sd: sd["loss_scale"].__setitem__("scale", torch.tensor(-1.0)), ValueError, "scale"),
        (
            lambda sd: sd["loss_scale"].__setitem__("scale", torch.tensor(float("nan"))),
            ValueError,
            "scale",
        ),
        (
            lambda sd: sd["loss_scale"].__setitem__("growth_tracker", torch.tensor(-3)),
            ValueError,
            "growth_tracker",
        ),
        (
            lambda sd: sd["loss_scale"]["config"].__setitem__("growth_factor", 0.5),
            ValueError,
            "growth_factor",
        ),
        (
            lambda sd: sd["loss_scale"]["config"].__setitem__("bogus", 1),
            ValueError,
            "unknown config",
        ),
        (lambda sd: sd["loss_scale"].__setitem__("scale", "big"), ValueError, "one-element tensor"),
        (lambda sd: sd.__setitem__("loss_scale", 3), TypeError, "must be a dict"),
        (lambda sd: sd["param_groups"].pop(), ValueError, "parameter groups"),
    ],
)
def test_corrupt_state_dict_is_rejected_and_changes_nothing(mutate, error, message) -> None:
    opt, state_dict = _corrupt(mutate)
    before = snapshot(opt)
    with pytest.raises(error, match=message):
        opt.load_state_dict(state_dict)
    assert_bit_identical(before, snapshot(opt))
