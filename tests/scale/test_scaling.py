"""The loss-scale state machine against a plain-Python model and against torch's own update."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim.scale import LossScale, ScalingConfig


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def python_model(config: ScalingConfig, overflows: list[bool], force: list[bool]) -> list[float]:
    """The state machine as plain Python: the spec the device version is held to.

    ``scale * factor`` is computed in float64 and rounded once to float32, as
    ``torch._amp_update_scale_`` does (Note [scale update]).
    """
    scale, growth, hysteresis = f32(config.init_scale), 0, config.hysteresis
    out = []
    for overflow, forced in zip(overflows, force):
        if overflow:
            hysteresis = max(hysteresis - 1, 0)
            growth = 0
            if forced or hysteresis <= 0:
                scale = max(f32(scale * config.backoff_factor), f32(config.min_scale))
        else:
            hysteresis = config.hysteresis
            growth += 1
            if growth >= config.growth_interval:
                grown = f32(scale * config.growth_factor)
                if math.isfinite(grown):
                    scale = min(grown, f32(config.max_scale))
                growth = 0
        out.append(scale)
    return out


def device_sequence(config: ScalingConfig, overflows: list[bool], force: list[bool]) -> list[float]:
    loss_scale = LossScale(config, torch.device("cpu"))
    out = []
    for overflow, forced in zip(overflows, force):
        loss_scale.update_(loss_scale.scale, torch.tensor(float(overflow)), force_backoff=forced)
        out.append(loss_scale.scale.item())
    return out


configs = st.builds(
    ScalingConfig,
    init_scale=st.sampled_from([1.0, 2.0**10, 2.0**16, 3.0e38]),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    growth_interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    min_scale=st.sampled_from([torch.finfo(torch.float32).tiny, 1.0]),
    max_scale=st.sampled_from([torch.finfo(torch.float32).max, 3.0e38]),
).filter(lambda c: c.min_scale <= c.init_scale <= c.max_scale)


@settings(max_examples=150, deadline=None)
@given(config=configs, overflows=st.lists(st.booleans(), max_size=40), data=st.data())
def test_device_state_machine_equals_python_model(config, overflows, data) -> None:
    force = data.draw(st.lists(st.booleans(), min_size=len(overflows), max_size=len(overflows)))
    assert device_sequence(config, overflows, force) == python_model(config, overflows, force)


@settings(max_examples=100, deadline=None)
@given(overflows=st.lists(st.booleans(), max_size=60), interval=st.integers(1, 4))
def test_defaults_reproduce_torch_amp_update_scale(overflows, interval) -> None:
    """Default config (but growth_interval) gives exactly torch.amp.GradScaler's scales."""
    config = ScalingConfig(growth_interval=interval)
    scale, tracker = torch.tensor(config.init_scale), torch.tensor(0, dtype=torch.int32)
    expected = []
    for overflow in overflows:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), 2.0, 0.5, interval)
        expected.append(scale.item())
    assert device_sequence(config, overflows, [False] * len(overflows)) == expected


@settings(max_examples=100, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=60),
    interval=st.integers(1, 4),
    growth=st.sampled_from([1.5, 1.1, 3.0, 2.0]),
    backoff=st.sampled_from([0.9, 0.3, 0.75, 0.5]),
    init=st.sampled_from([2.0**16, 1000.0, 3.3e37]),
)
def test_any_factors_reproduce_torch_amp_update_scale(
    overflows, interval, growth, backoff, init
) -> None:
    """Non-power-of-two factors: the same float64-product-rounded-once as GradScaler, hysteresis
    1 (torch's fast path) and hysteresis 2 with no overflow streaks (the general path)."""
    scale, tracker = torch.tensor(init), torch.tensor(0, dtype=torch.int32)
    expected = []
    for overflow in overflows:
        torch._amp_update_scale_(
            scale, tracker, torch.tensor(float(overflow)), growth, backoff, interval
        )
        expected.append(scale.item())
    config = ScalingConfig(
        init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
    )
    assert device_sequence(config, overflows, [False] * len(overflows)) == expected
    bounded = dataclasses.replace(config, max_scale=3.4e38)  # takes the general path
    assert device_sequence(bounded, overflows, [False] * len(overflows)) == [
        min(s, f32(3.4e38)) for s in expected
    ]


def test_scale_never_grows_to_inf() -> None:
    config = ScalingConfig(init_scale=2.0**127, growth_interval=1)
    assert device_sequence(config, [False] * 5, [False] * 5) == [2.0**127] * 5


def test_hysteresis_tolerates_n_minus_one_consecutive_overflows() -> None:
    config = ScalingConfig(init_scale=8.0, hysteresis=3, growth_interval=100)
    seq = [True, True, False, True, True, True, True]
    assert device_sequence(config, seq, [False] * len(seq)) == [8, 8, 8, 8, 8, 4, 2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(min_scale=4.0, init_scale=2.0), "bounds"),
        (dict(max_scale=float("inf")), "max_scale"),
        (dict(max_replays=-1), "max_replays"),
    ],
)
def test_bad_config_is_rejected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**kwargs)


def test_config_types_are_checked() -> None:
    with pytest.raises(TypeError, match="growth_interval"):
        ScalingConfig(growth_interval=2.5)
