"""Regression tests of single kernels that the row-driven kernel tests do not cover: the
read-only inf/nan check (finds any bad element, never writes a tensor or clears the flag), SGD's
fused rounding and SGD's first step over a loaded momentum buffer. The 16-bit conversions
are in test_emulated_dtypes.py, the launcher in test_launcher.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import kernels
from scaledoptim.testing.optim_db import row
from tests.support.launches import row_update
from tests.support.references import assert_param_close, reference_step
from tests.support.tensors import (
    CHUNK,
    DTYPES,
    boundary_params_and_grads,
    boundary_sizes,
    make_tensors,
    mixed_params_and_grads,
)

BAD_VALUES = (float("inf"), float("-inf"), float("nan"))


def tensors_with(dtype, bad_at=None, bad=float("nan")):
    tensors = make_tensors(
        boundary_sizes(CHUNK), dtype, torch.Generator().manual_seed(0), scale=100.0
    )
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
    sizes = [*boundary_sizes(CHUNK), boundary_sizes(CHUNK)[-1]]
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
    sgd = row("SGD")
    params, grads = mixed_params_and_grads([115], [(param_dtype, torch.float16)], seed=1)
    grads[0].copy_(params[0])
    plain = sgd.config("plain")
    expected, _ = reference_step(sgd, params, [g.float() for g in grads], [{}], plain, lr=0.99999)
    row_update(sgd, params, grads, plain, lr=0.99999).launch(None, None)
    assert_param_close(params[0], expected[0])


@pytest.mark.parametrize(
    "config", [c for c in row("SGD").configs if c.kwargs.get("momentum")], ids=str
)
def test_sgd_first_step_over_a_loaded_momentum_buffer_steps_as_torch_optim(config):
    """torch creates the buffer from the first taken step's grad; ours exists before, zeroed or
    loaded with a step count of 0 (torch's SGD saves no count). With dampening the first step
    overwrites whatever it holds; without, it is read, as torch.optim reads a loaded buffer and
    as SGD's torch form reads it (a zero buffer gives the copy of the grad exactly)."""
    sgd = row("SGD")
    generator = torch.Generator().manual_seed(4)
    params, grads = boundary_params_and_grads(torch.float32, torch.bfloat16, generator)
    update = row_update(sgd, params, grads, config)
    (buffers,) = (ts for key, ts in zip(update.keys, update.state) if key == "momentum_buffer")
    for buffer in buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=generator) * 100)
    if config.kwargs.get("dampening"):
        loaded: list[dict] = [{}] * len(params)  # the reference starts its buffers
    else:  # (torch's SGD reads only the buffer; the count makes the reference load it)
        loaded = [{"momentum_buffer": b.clone(), "step": torch.tensor(1.0)} for b in buffers]
    expected, _ = reference_step(sgd, params, [g.float() for g in grads], loaded, config)
    update.launch(torch.zeros(()), None)
    for actual, e in zip(params, expected):
        assert_param_close(actual, e)
