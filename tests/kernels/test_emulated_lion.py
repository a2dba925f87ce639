"""Emulated lion_ against the float64 formula (kernel_reference.reference_lion), step by step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import (
    CHUNK,
    DTYPES,
    assert_bytes_unchanged,
    assert_state_close,
    boundary_params_and_grads,
    compare_steps,
    lion_options,
    mixed_params_and_grads,
    reference_lion,
    snapshot,
)

from scaledoptim import kernels

# Everything a kernel table row needs: the kernel, its options grid, its reference.
CASE = dict(
    kernel=kernels.LION,
    launch=kernels.lion_,
    options=[
        lion_options(maximize=m, weight_decay=w)
        for m, w in itertools.product((False, True), (0.0, 0.5))
    ],
    reference=reference_lion,
)


def run_and_compare(params, grads, options, inv_scale, steps=3, seed=0):
    exp_avgs = [torch.zeros(p.shape) for p in params]
    counters = [torch.zeros(()) for _ in params]
    scale = torch.tensor(inv_scale) if inv_scale is not None else None

    def step(i):
        expected_params, expected_exp_avgs = CASE["reference"](
            params, grads, exp_avgs, inv_scale, options
        )
        CASE["launch"](
            params, grads, exp_avgs, counters, **options, found_inf=torch.zeros(()), inv_scale=scale
        )
        for actual, reference in zip(exp_avgs, expected_exp_avgs):
            assert_state_close(actual, reference.float())
        assert all(c.item() == i + 1 for c in counters)
        return [p.float() for p in expected_params]

    compare_steps(params, grads, steps, torch.Generator().manual_seed(seed), step)


@pytest.mark.parametrize(
    "options", CASE["options"], ids=lambda o: f"maximize={o['maximize']}-wd={o['weight_decay']}"
)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_the_formula_every_option_and_dtype(param_dtype, grad_dtype, options):
    params, grads = boundary_params_and_grads(
        param_dtype, grad_dtype, torch.Generator().manual_seed(1)
    )
    run_and_compare(params, grads, options, inv_scale=0.25)


@settings(max_examples=20, deadline=None)
@given(
    options=st.sampled_from(CASE["options"]),
    dtypes=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)), min_size=1, max_size=6
    ),
    sizes=st.lists(st.integers(0, 3 * CHUNK + 7), min_size=6, max_size=6),
    lr=st.floats(1e-4, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.0, 0.999),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_the_formula_for_mixed_dtypes_and_hyperparameters(
    options, dtypes, sizes, lr, beta1, beta2, inv_scale, seed
):
    params, grads = mixed_params_and_grads(sizes, dtypes, seed)
    run_and_compare(
        params, grads, {**options, "lr": lr, "beta1": beta1, "beta2": beta2}, inv_scale, 2, seed
    )


def test_skips_on_found_inf_and_leaves_everything_unchanged():
    params, grads = boundary_params_and_grads(
        torch.bfloat16, torch.float32, torch.Generator().manual_seed(2)
    )
    exp_avgs = [torch.randn(p.shape) for p in params]
    counters = [torch.zeros(()) for _ in params]
    before = snapshot(params + exp_avgs + counters)
    kernels.lion_(
        params,
        grads,
        exp_avgs,
        counters,
        **lion_options(),
        found_inf=torch.ones(()),
        inv_scale=None,
    )
    assert_bytes_unchanged(before, params + exp_avgs + counters)
