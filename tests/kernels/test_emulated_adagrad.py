"""Emulated adagrad_ against torch.optim.Adagrad (foreach=False), step by step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import (
    CHUNK,
    DTYPES,
    adagrad_options,
    assert_state_close,
    boundary_params_and_grads,
    compare_steps,
    mixed_params_and_grads,
    reference_adagrad,
)

from scaledoptim import kernels

# Everything a kernel table row needs: the kernel, its options grid, its reference.
CASE = dict(
    kernel=kernels.ADAGRAD,
    launch=kernels.adagrad_,
    options=[
        adagrad_options(maximize=m, weight_decay=w, lr_decay=d)
        for m, w, d in itertools.product((False, True), (0.0, 0.1), (0.0, 0.05))
    ],
    reference=reference_adagrad,
)


def run_and_compare(params, grads, options, inv_scale, steps=3, seed=0, initial_sum=0.1):
    sums = [torch.full(p.shape, initial_sum) for p in params]
    counters = [torch.zeros(()) for _ in params]
    scale = torch.tensor(inv_scale) if inv_scale is not None else None

    def step(_):
        expected_params, expected_sums, expected_steps = CASE["reference"](
            params, grads, sums, counters, inv_scale, options
        )
        CASE["launch"](
            params, grads, sums, counters, **options, found_inf=torch.zeros(()), inv_scale=scale
        )
        for actual, reference in zip(sums, expected_sums):
            assert_state_close(actual, reference)
        assert [c.item() for c in counters] == [c.item() for c in expected_steps]
        return expected_params

    compare_steps(params, grads, steps, torch.Generator().manual_seed(seed), step)


@pytest.mark.parametrize(
    "options",
    CASE["options"],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items() if k != "lr"),
)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_torch_every_option_and_dtype(param_dtype, grad_dtype, options):
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
    eps=st.floats(1e-10, 1e-3),
    initial_sum=st.floats(0.0, 1.0),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_for_mixed_dtypes_and_hyperparameters(
    options, dtypes, sizes, lr, eps, initial_sum, inv_scale, seed
):
    params, grads = mixed_params_and_grads(sizes, dtypes, seed)
    run_and_compare(
        params, grads, {**options, "lr": lr, "eps": eps}, inv_scale, 2, seed, initial_sum
    )
