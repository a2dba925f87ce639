"""float32, custom_fwd and custom_bwd."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp
from scaledoptim.amp.regions import in_scaledoptim_region


@settings(max_examples=4, deadline=None)
@given(low=st.sampled_from([torch.bfloat16, torch.float16]), n=st.integers(1, 4))
def test_float32_disables_autocast_and_casts_inputs_up(low, n):
    @amp.float32
    def full_precision(x, *, w):
        assert not torch.is_autocast_enabled("cpu")
        assert (x.dtype, w.dtype) == (torch.float32, torch.float32)
        return x @ w

    with amp.autocast("cpu", dtype=low):
        out = full_precision(torch.randn(n, 3, dtype=low), w=torch.randn(3, 2, dtype=low))
        assert torch.is_autocast_enabled("cpu")
    assert out.dtype == torch.float32


class _Scale(torch.autograd.Function):
    record: ClassVar[dict] = {}

    @staticmethod
    @amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        _Scale.record["fwd"] = (torch.is_autocast_enabled("cpu"), in_scaledoptim_region("cpu"))
        return torch.mm(x, w)

    @staticmethod
    @amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        _Scale.record["bwd"] = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            in_scaledoptim_region("cpu"),
            torch.exp(grad.float()).dtype,  # exp is edited to lower precision in the test
        )
        return grad @ w.t().to(grad.dtype), x.t().to(grad.dtype) @ grad


@pytest.mark.parametrize("region", [amp.autocast, torch.autocast])
def test_custom_bwd_reenters_the_forward_region(region):
    amp.set_policy("aten::exp", "lower_precision_fp", "cpu")
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    with region("cpu", dtype=torch.float16):
        y = _Scale.apply(x, w)
    y.float().sum().backward()
    ours = region is amp.autocast
    assert _Scale.record["fwd"] == (True, ours)
    expected_exp = torch.float16 if ours else torch.float32
    assert _Scale.record["bwd"] == (True, torch.float16, ours, expected_exp)


class _Square(torch.autograd.Function):
    @staticmethod
    @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        assert not torch.is_autocast_enabled("cpu")
        assert x.dtype == torch.float32
        ctx.save_for_backward(x)
        return torch.mm(x, x)

    @staticmethod
    @amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        assert not torch.is_autocast_enabled("cpu")
        (x,) = ctx.saved_tensors
        return grad @ x.t() + x.t() @ grad


def test_custom_fwd_cast_inputs_runs_forward_in_fp32_without_autocast():
    x = torch.randn(3, 3, dtype=torch.bfloat16, requires_grad=True)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        y = _Square.apply(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_custom_bwd_without_custom_fwd_says_what_to_do():
    class Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad * 2

    with pytest.raises(RuntimeError, match="custom_fwd"):
        Broken.apply(torch.randn(2, requires_grad=True)).sum().backward()
