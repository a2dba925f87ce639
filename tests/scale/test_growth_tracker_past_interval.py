"""A growth tracker at or past the growth interval (``set_growth_interval(n)`` below the clean
iterations already counted) moves by torch's rule wherever it lands: the scale does not grow until
an overflow resets the tracker, then grows every ``interval`` clean steps again (Note [growth
tracker past the interval]). Checked against torch.amp.GradScaler continuing the same state:
imported with ``load_gradscaler_state_dict`` and stepped by the optimizer's own protocol (both
update paths, and the torch-op rule used with hysteresis or a scale ceiling), and through
``scaledoptim.GradScaler``."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from tests.scale.test_gradscaler_state import _gradscaler_steps, _loss, _model, _scaledoptim_steps

pytestmark = pytest.mark.usefixtures("kernel_backend")

INTERVAL = 2
STEPS = range(10)
OVERFLOWS = {4}  # resets the tracker: growth every INTERVAL clean steps after it


def _torch_state(tracker: int) -> dict:
    """torch.amp.GradScaler's state after ``tracker`` clean iterations at interval 10, shortened
    to ``INTERVAL``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=10)
    _gradscaler_steps(model, opt, scaler, range(100, 100 + tracker), set())
    scaler.set_growth_interval(INTERVAL)
    state = scaler.state_dict()
    assert state["_growth_tracker"] == tracker
    return state


def _expected(state: dict) -> list[float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state)
    return _gradscaler_steps(model, opt, scaler, STEPS, OVERFLOWS)


#: A scale ceiling takes LossScale.update_'s rule in torch ops, not torch's op.
SCALING = {"as-gradscaler": {}, "ceiling": {"max_scale": 2.0**20}}


@pytest.mark.parametrize("tracker", [INTERVAL, INTERVAL + 3])
@pytest.mark.parametrize("scaling", list(SCALING))
def test_an_imported_tracker_past_the_interval_moves_as_under_gradscaler(tracker, scaling) -> None:
    state = _torch_state(tracker)
    expected = _expected(state)
    assert expected[:4] == [8.0] * 4  # torch: no growth before the overflow...
    assert expected[4:] == [4.0, 4.0, 8.0, 8.0, 16.0, 16.0]  # ...then every INTERVAL steps

    model = _model()
    opt = scaledoptim.SGD(model.parameters(), lr=1e-2)
    opt.configure_scaling(**SCALING[scaling])
    opt.load_gradscaler_state_dict(state)
    assert _scaledoptim_steps(model, opt, STEPS, OVERFLOWS) == expected


@pytest.mark.parametrize("tracker", [INTERVAL, INTERVAL + 3])
def test_the_split_form_and_the_facade_move_it_as_gradscaler(tracker) -> None:
    state = _torch_state(tracker)
    expected = _expected(state)

    model = _model()
    opt = scaledoptim.SGD(model.parameters(), lr=1e-2)
    opt.load_gradscaler_state_dict(state)
    scales = []
    for step in STEPS:
        opt.zero_grad()
        scaledoptim.scale_outputs(_loss(model, step), opt.scale).backward()
        if step in OVERFLOWS:
            model[2].bias.grad[0] = float("inf")
        _, scale = opt.unscale(grads_scaled_by=opt.scale)
        opt.step_after_unscale()
        scales.append(scale.item())
    assert scales == expected

    model = _model()
    opt = scaledoptim.SGD(model.parameters(), lr=1e-2)
    scaler = scaledoptim.GradScaler("cpu")
    scaler.load_state_dict(state)
    assert _gradscaler_steps(model, opt, scaler, STEPS, OVERFLOWS) == expected
    assert opt.scale.item() == expected[-1]


def test_hysteresis_keeps_a_tracker_past_the_interval_from_growing_until_a_backoff() -> None:
    """With hysteresis 2, a tolerated overflow also resets the tracker (any overflow does):
    growth resumes after it, at the interval."""
    model = _model()
    opt = scaledoptim.SGD(model.parameters(), lr=1e-2).configure_scaling(hysteresis=2)
    opt.load_gradscaler_state_dict(_torch_state(INTERVAL + 3))
    scales = _scaledoptim_steps(model, opt, STEPS, OVERFLOWS)
    assert scales == [8.0] * 4 + [8.0, 8.0, 16.0, 16.0, 32.0, 32.0]
