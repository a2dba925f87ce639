"""Scale configs at their edges, on both backends (our kernels move the scale in the step's
epilogue, torch's ops in ``LossScale.update_``): ``growth_interval`` of 2**31 or more (the
GradScaler idiom for "never grow", e.g. ``sys.maxsize``) never grows the scale, and a
``hysteresis`` that large never backs off, smaller ones count as before; a backoff stops at
``min_scale``, a growth at ``max_scale``."""

from __future__ import annotations

import sys

import pytest
import torch

import scaledoptim
from scaledoptim.scale import LossScale, ScalingConfig

pytestmark = pytest.mark.usefixtures("kernel_backend")

NEVER = [2**31, 2**32 + 3, sys.maxsize, 2**64 + 1]
SHAPES = {  # the update's branches: torch._amp_update_scale_ only for GradScaler's semantics
    "gradscaler": {},
    "hysteresis": {"hysteresis": 3},
    "max_scale": {"max_scale": 2.0**30},
}


def _steps(opt, params, overflows: list[bool]) -> list[float]:
    scales = []
    for overflow in overflows:
        for p in params:
            p.grad = torch.randn_like(p)
        if overflow:
            params[0].grad[0] = float("inf")
        _, _, scale = opt.unscale_and_step(grads_scaled_by=opt.scale)
        scales.append(scale.item())
    return scales


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("growth_interval", NEVER)
def test_a_growth_interval_beyond_int32_never_grows(growth_interval, shape) -> None:
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(
        init_scale=2.0**10, growth_interval=growth_interval, **SHAPES[shape]
    )
    scales = _steps(opt, params, [False] * 6)
    assert scales == [2.0**10] * 6
    assert opt.state_dict()["loss_scale"]["growth_tracker"].item() == 6


@pytest.mark.parametrize("growth_interval", NEVER)
def test_gradscaler_agrees(growth_interval) -> None:
    """torch's own update (what GradScaler calls) with the same interval."""
    scale, tracker = torch.full((), 2.0**10), torch.zeros((), dtype=torch.int32)
    found_inf = torch.zeros(())
    for _ in range(6):
        torch._amp_update_scale_(
            scale, tracker, found_inf, 2.0, 0.5, min(growth_interval, sys.maxsize)
        )
    assert scale.item() == 2.0**10 and tracker.item() == 6


@pytest.mark.parametrize("shape", SHAPES)
def test_small_intervals_still_grow_and_back_off(shape) -> None:
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(
        init_scale=2.0**10, growth_interval=2, **{**SHAPES[shape], "hysteresis": 1}
    )
    assert _steps(opt, params, [False, False, True, False]) == [2.0**10, 2.0**11, 2.0**10, 2.0**10]


@pytest.mark.parametrize("hysteresis", [2**31 - 1, 2**31, sys.maxsize])
def test_a_hysteresis_beyond_int32_tolerates_every_overflow(hysteresis) -> None:
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(init_scale=2.0**10, hysteresis=hysteresis)
    assert _steps(opt, params, [True, True, False, True]) == [2.0**10] * 4


def test_the_torch_ops_update_compares_in_64_bits() -> None:
    """LossScale.update_ itself (hysteresis 3 leaves torch._amp_update_scale_)."""
    loss_scale = LossScale(ScalingConfig(growth_interval=2**40, hysteresis=3), torch.device("cpu"))
    loss_scale.growth_tracker.fill_(2**31 - 2)
    loss_scale.update_(loss_scale.scale, torch.zeros(()))
    assert loss_scale.scale.item() == 2.0**16
    assert loss_scale.growth_tracker.item() == 2**31 - 1


@pytest.mark.parametrize("shape", SHAPES)
def test_a_backoff_stops_at_min_scale(shape) -> None:
    """Exists for a backoff that passes ``min_scale`` (mutant kernel-backoff-below-min-scale)."""
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(
        init_scale=8.0, min_scale=2.0, **SHAPES[shape]
    )
    hysteresis = SHAPES[shape].get("hysteresis", 1)  # overflows in a row to back off once
    scales = _steps(opt, params, [True] * (hysteresis + 3))
    assert scales[hysteresis - 1 :] == [4.0, 2.0, 2.0, 2.0]


def test_a_growth_stops_at_max_scale() -> None:
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(
        init_scale=2.0**9, max_scale=2.0**10, growth_interval=1
    )
    assert _steps(opt, params, [False] * 3) == [2.0**10] * 3
