"""The scale stays within ``[min_scale, max_scale]`` on both backends (our kernels move it in the
step's epilogue, torch's ops in ``LossScale.update_``), on every branch of the update: a backoff
stops at ``min_scale``, a growth at ``max_scale``, and neither is ever reached early."""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

SHAPES = {  # the update's branches: torch._amp_update_scale_ only for GradScaler's semantics
    "gradscaler": {},
    "max_scale": {"max_scale": 2.0**30},
    "forced": {"hysteresis": 2},  # hysteresis 2, two overflows in a row back off once
}


def _scales(opt, params, overflows: list[bool]) -> list[float]:
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
def test_a_backoff_stops_at_min_scale(shape) -> None:
    """Exists for a backoff that passes ``min_scale`` (mutant kernel-backoff-below-min-scale)."""
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(
        init_scale=8.0, min_scale=2.0, **SHAPES[shape]
    )
    per_backoff = 2 if shape == "forced" else 1  # overflows in a row to back off once
    scales = _scales(opt, params, [True] * (4 * per_backoff))
    assert scales[per_backoff - 1 :: per_backoff] == [4.0, 2.0, 2.0, 2.0]


def test_a_growth_stops_at_max_scale() -> None:
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = scaledoptim.AdamW(params).configure_scaling(
        init_scale=2.0**9, max_scale=2.0**10, growth_interval=1
    )
    assert _scales(opt, params, [False] * 3) == [2.0**10] * 3
