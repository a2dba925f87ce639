"""Edited policies apply inside scaledoptim regions only; custom ops get their policy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp

LOW = st.sampled_from([torch.bfloat16, torch.float16])


def _softmax_and_mm_dtypes():
    x = torch.randn(3, 4)
    return torch.softmax(x, -1).dtype, torch.mm(x, torch.randn(4, 2)).dtype


@settings(max_examples=4, deadline=None)
@given(low=LOW)
def test_edit_applies_in_scaledoptim_region_and_not_in_plain_torch_region(low):
    amp.set_policy(torch.ops.aten.softmax, "lower_precision_fp", "cpu")
    amp.set_policy("aten::mm", "fp32", "cpu")
    with torch.autocast("cpu", dtype=low):
        assert _softmax_and_mm_dtypes() == (torch.float32, low)
    with amp.autocast("cpu", dtype=low):
        assert _softmax_and_mm_dtypes() == (low, torch.float32)
        with torch.autocast("cpu", dtype=low):  # a plain region inside ours is torch's
            assert _softmax_and_mm_dtypes() == (torch.float32, low)
        assert _softmax_and_mm_dtypes() == (low, torch.float32)
    with torch.autocast("cpu", dtype=low):
        with amp.autocast("cpu", dtype=low):  # ours inside a plain region is ours
            assert _softmax_and_mm_dtypes() == (low, torch.float32)
        assert _softmax_and_mm_dtypes() == (torch.float32, low)


def test_edited_op_saves_cast_inputs_for_backward():
    amp.set_policy("aten::mm", "fp32", "cpu")
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.bfloat16, requires_grad=True)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        y = torch.mm(x, w)
    assert y.grad_fn._saved_mat2.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(
        x.grad.float(), torch.ones(3, 2) @ w.float().t(), rtol=1e-2, atol=1e-2
    )


def test_fp32_set_opt_dtype_sets_dtype_unless_given():
    amp.set_policy("aten::softmax.int", "fp32_set_opt_dtype", "cpu")
    amp.set_policy("aten::sum.dim_IntList", "fp32_set_opt_dtype", "cpu")
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        softmax = torch.softmax(x, -1)
        total = x.sum(1)
        total_f64 = x.sum(1, dtype=torch.float64)
        double = torch.softmax(x.double(), -1)  # ineligible: untouched
    assert torch.equal(softmax, torch.softmax(x, -1, dtype=torch.float32))
    assert torch.equal(total, x.sum(1, dtype=torch.float32))
    assert (total_f64.dtype, double.dtype) == (torch.float64, torch.float64)


def test_fp32_append_dtype_redispatches_to_dtype_overload():
    amp.set_policy("aten::norm.Scalar", "fp32_append_dtype", "cpu")
    x = torch.randn(5, dtype=torch.bfloat16)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        norm = torch.ops.aten.norm.Scalar(x, 2)
    assert norm.dtype == torch.float32
    assert torch.equal(norm, torch.ops.aten.norm.ScalarOpt_dtype(x, 2, dtype=torch.float32))


def test_promote_edit_widens_to_float32():
    amp.set_policy("aten::mm", "promote", "cpu")
    with amp.autocast("cpu", dtype=torch.bfloat16):
        mixed = torch.mm(torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(3, 2))
        low = torch.mm(
            torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(3, 2, dtype=torch.bfloat16)
        )
    assert (mixed.dtype, low.dtype) == (torch.float32, torch.bfloat16)


def test_none_policy_removes_casting():
    amp.set_policy("aten::mm", None, "cpu")
    assert amp.get_policy("aten::mm", "cpu") is None
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16


# A custom op defined with torch.library, as an extension would; it records what it got.
SEEN_DTYPES: list[tuple[torch.dtype, torch.dtype]] = []
_LIBRARY = torch.library.Library("scaledoptim_test", "DEF")
_LIBRARY.define("scaled_mul(Tensor x, Tensor w) -> Tensor")


def _scaled_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    SEEN_DTYPES.append((x.dtype, w.dtype))
    return x * w * 2


_LIBRARY.impl("scaled_mul", _scaled_mul, "CompositeImplicitAutograd")
SCALED_MUL = torch.ops.scaledoptim_test.scaled_mul


@pytest.mark.parametrize(
    "policy, expected", [("lower_precision_fp", torch.bfloat16), ("fp32", torch.float32)]
)
def test_custom_op_is_cast_per_its_policy(policy, expected):
    assert amp.get_policy(SCALED_MUL, "cpu") is None
    amp.set_policy("scaledoptim_test::scaled_mul", policy, "cpu")
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    SEEN_DTYPES.clear()
    with amp.autocast("cpu", dtype=torch.bfloat16):
        y = SCALED_MUL(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        SCALED_MUL(x, w)  # plain torch region: the op falls through, as torch would
    assert SEEN_DTYPES == [(expected, expected), (torch.float32, torch.bfloat16)]
    assert y.dtype == expected
    y.sum().backward()
    assert (x.grad.dtype, w.grad.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(x.grad, 2 * w.detach().float(), rtol=1e-2, atol=1e-2)
