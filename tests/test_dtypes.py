"""Every path and every param dtype against an fp32 reference, and the torch kernel we route around."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizer_table import CASES, OptimizerCase, assert_bit_identical, snapshot

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _params(dtype: torch.dtype, sizes=(1, 5, 16, 33)) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]


def _fp32_reference_step(case: OptimizerCase, opt, params, grads_fp32) -> list[torch.Tensor]:
    """torch.optim's step from our current state, in fp32, rounded once to the param dtype."""
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ref = case.reference(ref_params, **case.kwargs)
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict.pop("loss_scale")
    ref.load_state_dict(state_dict)
    for p, g in zip(ref_params, grads_fp32):
        p.grad = g.clone()
    ref.step()
    return [r.detach().to(p.dtype) for r, p in zip(ref_params, params)]


def _assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """16-bit: one ulp of the dtype. fp32: 1e-6 relative, where an element that cancels down to
    a small value is held to 1e-6 of the tensor's largest magnitude (kernels may fuse the
    multiply-adds that torch rounds separately)."""
    info = torch.finfo(actual.dtype)
    if actual.dtype == torch.float32:
        rtol, atol = 1e-6, 1e-6 * expected.abs().max().item()
    else:
        rtol, atol = info.eps, info.tiny
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["step", "unscale_and_step", "unscale+step_after_unscale"])
def test_every_path_and_dtype_matches_the_fp32_reference(case, dtype, path) -> None:
    params = _params(dtype)
    opt = case.ours(params, **case.kwargs).configure_scaling(init_scale=2.0**10)
    for _ in range(4):
        grads_fp32 = [torch.randn(p.shape) for p in params]
        S = opt.scale.item()
        expected = _fp32_reference_step(case, opt, params, [g.to(dtype).float() for g in grads_fp32])
        for p, g in zip(params, grads_fp32):
            p.grad = g.to(dtype) if path == "step" else (g.to(dtype).float() * S).to(dtype)
        if path == "step":
            opt.step()
        elif path == "unscale_and_step":
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        else:
            if dtype == torch.float16:  # unscale() refuses fp16 grads (issue 20, item 10)
                with pytest.raises(ValueError, match="fp16 grads"):
                    opt.unscale(grads_scaled_by=opt.scale)
                return
            opt.unscale(grads_scaled_by=opt.scale)
            opt.step_after_unscale()
        for p, e in zip(params, expected):
            assert p.dtype == dtype
            _assert_within_one_ulp(p.detach(), e)
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values())


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(CASES),
    dtype=st.sampled_from(DTYPES),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    bad_value=st.sampled_from([float("inf"), float("-inf"), float("nan")]),
    data=st.data(),
)
def test_random_inf_nan_never_changes_a_param_on_that_step(case, dtype, sizes, bad_value, data) -> None:
    params = _params(dtype, sizes)
    opt = case.ours(params, **case.kwargs)
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
