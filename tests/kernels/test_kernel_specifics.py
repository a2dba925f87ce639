"""Regression tests of single kernels that the generic tests of KERNEL_CASES do not cover: the
read-only inf/nan check (finds any bad element, never writes a tensor or clears the flag) and
SGD's fused rounding. The 16-bit conversions are in test_emulated_dtypes.py, the launcher in
test_launcher.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledoptim
from scaledoptim import kernels
from tests.kernels.kernel_reference import (
    CHUNK,
    DTYPES,
    assert_param_close,
    make_tensors,
    mixed_params_and_grads,
    reference_sgd,
    sgd_options,
    test_sizes,
)

BAD_VALUES = (float("inf"), float("-inf"), float("nan"))


def tensors_with(dtype, bad_at=None, bad=float("nan")):
    tensors = make_tensors(test_sizes(CHUNK), dtype, torch.Generator().manual_seed(0), scale=100.0)
    if bad_at is not None:
        tensor, index = bad_at
        tensors[tensor].view(-1)[index] = bad
    return tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_leaves_flag_and_tensors_alone_when_finite(dtype):
    tensors = tensors_with(dtype)
    before = [t.clone() for t in tensors]
    found_inf = torch.zeros(())
    kernels.non_finite_check_(tensors, found_inf)
    assert found_inf.item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    tensor=st.integers(1, 9),  # every non-empty tensor, the misaligned view included
    position=st.floats(0, 1, exclude_max=True),
    bad=st.sampled_from(BAD_VALUES),
)
def test_check_finds_any_bad_element(dtype, tensor, position, bad):
    sizes = test_sizes(CHUNK) + [test_sizes(CHUNK)[-1]]
    index = int(position * sizes[tensor])
    tensors = tensors_with(dtype, (tensor, index), bad)
    found_inf = torch.zeros(())
    kernels.non_finite_check_(tensors, found_inf)
    assert found_inf.item() == 1.0


def test_the_check_never_clears_the_flag():
    found_inf = torch.ones(())
    kernels.non_finite_check_(tensors_with(torch.float32), found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_sgd_update_that_nearly_cancels_the_param_keeps_torchs_fused_rounding(param_dtype):
    """p - lr * g with g == p and lr close to 1: computed with separate roundings the update
    lands 2 fp16 ulps from torch (found by hypothesis); one fmaf, as torch does, keeps it."""
    params, grads = mixed_params_and_grads([115], [(param_dtype, torch.float16)], seed=1)
    grads[0].copy_(params[0])
    options = sgd_options(momentum=0.0, lr=0.99999)
    steps = [torch.zeros(())]
    expected, _ = reference_sgd(params, grads, [[]], steps, None, options)
    scaledoptim.optim.sgd.sgd_(params, grads, [], steps, **options, found_inf=None, inv_scale=None)
    assert_param_close(params[0], expected[0])
