"""Emulated non_finite_check_ and unscale_, against torch's
_amp_foreach_non_finite_check_and_unscale_."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import CHUNK, DTYPES, make_tensors, test_sizes

from scaledoptim import kernels

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
def test_check_and_unscale_find_any_bad_element(dtype, tensor, position, bad):
    sizes = test_sizes(CHUNK) + [test_sizes(CHUNK)[-1]]
    index = int(position * sizes[tensor])
    for op in ("check", "unscale"):
        tensors = tensors_with(dtype, (tensor, index), bad)
        found_inf = torch.zeros(())
        if op == "check":
            kernels.non_finite_check_(tensors, found_inf)
        else:
            kernels.unscale_(tensors, found_inf, torch.tensor(0.5))
        assert found_inf.item() == 1.0, op


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", (None, float("inf")))
def test_unscale_matches_torch(dtype, bad):
    ours = tensors_with(dtype, None if bad is None else (8, 3), bad if bad else 0.0)
    theirs = [t.clone() for t in ours]
    found_ours, found_theirs = torch.zeros(()), torch.zeros(())
    inv_scale = torch.tensor(2.0**-10)
    kernels.unscale_(ours, found_ours, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv_scale)
    assert found_ours.item() == found_theirs.item()
    for a, b in zip(ours, theirs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) or torch.equal(
            a.isnan(), b.isnan()
        )


def test_producers_never_clear_the_flag():
    found_inf = torch.ones(())
    kernels.non_finite_check_(tensors_with(torch.float32), found_inf)
    kernels.unscale_(tensors_with(torch.float32), found_inf, torch.tensor(1.0))
    assert found_inf.item() == 1.0
