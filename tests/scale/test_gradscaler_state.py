"""Carrying a torch.amp.GradScaler checkpoint's scale into scaledoptim, and back."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledoptim

GROWTH_INTERVAL = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def _poison(model: torch.nn.Module, step: int, overflows: set[int]) -> None:
    if step in overflows:
        model[2].bias.grad[0] = float("inf")


def _gradscaler_steps(model, opt, scaler, steps, overflows) -> list[float]:
    scales = []
    for step in steps:
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        _poison(model, step, overflows)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _scaledoptim_steps(model, opt, steps, overflows) -> list[float]:
    scales, S = [], opt.scale
    for step in steps:
        opt.zero_grad()
        scaledoptim.scale_outputs(_loss(model, step), S).backward()
        _poison(model, step, overflows)
        _, _, S = opt.unscale_and_step(grads_scaled_by=S)
        scales.append(S.item())
    return scales


def _torch_pair(model, fused: bool = True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    return opt, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)


def _ours(model):
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    return opt.configure_scaling(init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)


STEPS = 12
overflow_sets = st.sets(st.integers(0, STEPS - 1), max_size=5)
handovers = st.integers(0, STEPS)


@settings(max_examples=15, deadline=None)
@given(overflows=overflow_sets, handover=handovers)
def test_resuming_a_gradscaler_run_continues_its_scale_sequence(overflows, handover) -> None:
    """GradScaler for `handover` steps, then scaledoptim: same scales, skips and params as a run
    that used GradScaler throughout. A skip is a step that left the params unchanged."""
    reference = _model()
    opt, scaler = _torch_pair(reference)
    expected = _gradscaler_steps(reference, opt, scaler, range(STEPS), overflows)

    model = _model()
    opt, scaler = _torch_pair(model)
    scales = _gradscaler_steps(model, opt, scaler, range(handover), overflows)
    ours = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    ours.load_state_dict(opt.state_dict())
    ours.load_gradscaler_state_dict(scaler.state_dict())
    scales += _scaledoptim_steps(model, ours, range(handover, STEPS), overflows)

    assert scales == expected
    for ours_p, ref_p in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours_p, ref_p, rtol=1e-5, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(overflows=overflow_sets, handover=handovers)
def test_exported_state_lets_gradscaler_continue_the_sequence(overflows, handover) -> None:
    reference = _model()
    expected = _scaledoptim_steps(reference, _ours(reference), range(STEPS), overflows)

    model = _model()
    ours = _ours(model)
    scales = _scaledoptim_steps(model, ours, range(handover), overflows)
    # scaledoptim's param_groups carry no "fused" flag, so torch's loaded optimizer is unfused.
    opt, scaler = _torch_pair(model, fused=False)
    opt.load_state_dict(ours.state_dict())
    scaler.load_state_dict(ours.gradscaler_state_dict())
    scales += _gradscaler_steps(model, opt, scaler, range(handover, STEPS), overflows)
    assert scales == expected


def test_exported_state_has_gradscalers_types() -> None:
    model = _model()
    ours = _ours(model)
    _scaledoptim_steps(model, ours, range(4), overflows={1})
    state = ours.gradscaler_state_dict()
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    assert state == scaler.state_dict()
    assert [type(state[k]) for k in ("scale", "growth_interval", "_growth_tracker")] == [
        float,
        int,
        int,
    ]
    assert state["scale"] == 2.0**9 and state["_growth_tracker"] == 2


def test_an_unused_enabled_gradscaler_loads_as_its_init_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, growth_interval=7)
    opt = scaledoptim.SGD(_model().parameters(), lr=0.1)
    opt.load_gradscaler_state_dict(scaler.state_dict())
    loss_scale = opt.scaling_state.loss_scale
    assert opt.scale.item() == 1024.0 and loss_scale.growth_tracker.item() == 0
    assert (loss_scale.config.growth_factor, loss_scale.config.growth_interval) == (4.0, 7)


def test_a_loaded_scale_keeps_the_optimizers_hysteresis_with_a_full_allowance() -> None:
    opt = scaledoptim.SGD(_model().parameters(), lr=0.1).configure_scaling(hysteresis=3)
    opt.load_gradscaler_state_dict(torch.amp.GradScaler("cpu").state_dict())
    loss_scale = opt.scaling_state.loss_scale
    assert loss_scale.config.hysteresis == 3 and loss_scale.hysteresis_tracker.item() == 3


def _valid() -> dict:
    return {
        "scale": 512.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 10,
        "_growth_tracker": 3,
    }


def _bad(id: str, error: type, names: str, **changes):
    return pytest.param({**_valid(), **changes}, error, names, id=id)


BAD = [
    pytest.param({}, ValueError, "disabled GradScaler", id="disabled-scaler"),
    pytest.param(torch.amp.GradScaler("cpu"), TypeError, "scaler.state_dict()", id="the-scaler"),
    pytest.param([("scale", 1.0)], TypeError, "got a list", id="not-a-dict"),
    pytest.param(
        {k: v for k, v in _valid().items() if k != "_growth_tracker"},
        ValueError,
        "missing keys ['_growth_tracker']",
        id="missing-key",
    ),
    _bad("unknown-key", ValueError, "unknown keys ['hysteresis']", hysteresis=2),
    _bad("none", TypeError, "'_growth_tracker'", _growth_tracker=None),
    _bad("tensor-scale", TypeError, "'scale'", scale=torch.tensor(512.0)),
    _bad("float-interval", TypeError, "'growth_interval'", growth_interval=10.0),
    _bad("bool-tracker", TypeError, "'_growth_tracker'", _growth_tracker=True),
    _bad("negative-tracker", ValueError, "'_growth_tracker'", _growth_tracker=-1),
    _bad("inf-scale", ValueError, "'scale'", scale=float("inf")),
    _bad("zero-scale", ValueError, "'scale'", scale=0.0),
    _bad("no-growth", ValueError, "'growth_factor'", growth_factor=1.0),
    _bad("backoff", ValueError, "'backoff_factor'", backoff_factor=1.5),
    _bad("interval", ValueError, "'growth_interval'", growth_interval=0),
]


@pytest.mark.parametrize(("state", "error", "names"), BAD)
def test_bad_gradscaler_state_is_refused_and_changes_nothing(state, error, names) -> None:
    opt = scaledoptim.SGD(_model().parameters(), lr=0.1).configure_scaling(init_scale=64.0)
    before = opt.scaling_state.loss_scale
    with pytest.raises(error) as info:
        opt.load_gradscaler_state_dict(state)
    assert names in str(info.value)
    assert opt.scaling_state.loss_scale is before and before.scale.item() == 64.0


def test_a_scale_outside_the_configured_bounds_names_the_fix() -> None:
    opt = scaledoptim.SGD(_model().parameters(), lr=0.1).configure_scaling(max_scale=2.0**20)
    with pytest.raises(ValueError, match="configure_scaling"):
        opt.load_gradscaler_state_dict({**_valid(), "scale": 2.0**24})


def test_export_warns_about_what_gradscaler_cannot_hold() -> None:
    opt = scaledoptim.SGD(_model().parameters(), lr=0.1).configure_scaling(hysteresis=2)
    with pytest.warns(UserWarning, match="hysteresis=2"):
        opt.gradscaler_state_dict()
    opt.configure_scaling()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.gradscaler_state_dict()


def test_import_and_export_refuse_a_pending_step() -> None:
    model = _model()
    opt = scaledoptim.SGD(model.parameters(), lr=0.1)
    scaledoptim.scale_outputs(_loss(model, 0), opt.scale).backward()
    opt.unscale(grads_scaled_by=opt.scale)
    for call in (opt.gradscaler_state_dict, lambda: opt.load_gradscaler_state_dict(_valid())):
        with pytest.raises(RuntimeError, match="between unscale"):
            call()
