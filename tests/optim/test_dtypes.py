"""Every path and every param dtype against the row's reference (the torch.optim class in fp32,
or the optimizer's own torch form in float64), rounded once; random inf/nan never changes a
param on that step.

Runs every generic config of every fused row (the kernel tests sweep the rest).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim.testing.optim_db import Config, OptimInfo, rows
from tests.support.references import assert_within_one_ulp, reference_step
from tests.support.training import assert_bit_identical, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CONFIGS = [
    pytest.param(info, config, id=f"{info.name}-{config.name}")
    for info in rows(fused=True)
    for config in info.generic_configs
]


def _params(dtype: torch.dtype, sizes=(1, 5, 16, 33)) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]


def _reference_step(info: OptimInfo, config: Config, opt, params, grads_fp32) -> list[torch.Tensor]:
    """The reference's step from our current state, rounded once to the param dtype."""
    states = [opt.state.get(p, {}) for p in params]
    expected, _ = reference_step(info, params, grads_fp32, states, config)
    return [e.to(p.dtype) for e, p in zip(expected, params)]


@pytest.mark.parametrize(("info", "config"), CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["step", "unscale_and_step", "unscale+step_after_unscale"])
def test_every_path_and_dtype_matches_the_reference(info, config, dtype, path) -> None:
    params = _params(dtype)
    opt = info.make(params, config).configure_scaling(init_scale=2.0**10)
    for _ in range(4):
        grads_fp32 = [torch.randn(p.shape) for p in params]
        S = opt.scale.item()
        expected = _reference_step(
            info, config, opt, params, [g.to(dtype).float() for g in grads_fp32]
        )
        for p, g in zip(params, grads_fp32):
            p.grad = g.to(dtype) if path == "step" else (g.to(dtype).float() * S).to(dtype)
        if path == "step":
            opt.step()
        elif path == "unscale_and_step":
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        else:
            if dtype == torch.float16:  # unscale() refuses fp16 grads, as GradScaler does
                with pytest.raises(ValueError, match="fp16 grads"):
                    opt.unscale(grads_scaled_by=opt.scale)
                return
            opt.unscale(grads_scaled_by=opt.scale)
            opt.step_after_unscale()
        for p, e in zip(params, expected):
            assert p.dtype == dtype
            assert_within_one_ulp(p.detach(), e)
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values())


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(CONFIGS),
    dtype=st.sampled_from(DTYPES),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    bad_value=st.sampled_from([float("inf"), float("-inf"), float("nan")]),
    data=st.data(),
)
def test_random_inf_nan_never_changes_a_param_on_that_step(
    case, dtype, sizes, bad_value, data
) -> None:
    info, config = case.values
    params = _params(dtype, sizes)
    opt = info.make(params, config)
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    opt.unscale_and_step(grads_scaled_by=opt.scale)  # state exists: the skip must leave it too
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    which = data.draw(st.integers(0, len(params) - 1))
    where = data.draw(st.integers(0, params[which].numel() - 1))
    params[which].grad.view(-1)[where] = bad_value
    before = snapshot(opt)
    _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    after = snapshot(opt)
    assert_bit_identical(before[:-3], after[:-3])  # params and state; the scale backed off
    assert S.item() == before[-3].item() / 2
