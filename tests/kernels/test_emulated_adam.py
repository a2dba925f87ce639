"""Emulated adam_ against torch.optim.Adam/AdamW (foreach=False), step by step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import (
    CHUNK,
    DTYPES,
    AdamState,
    assert_state_close,
    boundary_params_and_grads,
    compare_steps,
    mixed_params_and_grads,
    reference_adam,
    zero_adam_state,
)

from scaledoptim import kernels

OPTIONS = [
    dict(decoupled_weight_decay=d, amsgrad=a, maximize=m, weight_decay=w)
    for d, a, m, w in itertools.product((False, True), (False, True), (False, True), (0.0, 0.1))
]


def run_and_compare(params, grads, options, hyper, inv_scale, steps=3, seed=0):
    exp_avgs, exp_avg_sqs, counters = zero_adam_state(params)
    max_exp_avg_sqs = [torch.zeros(p.shape) for p in params] if options["amsgrad"] else []
    state = AdamState(exp_avgs, exp_avg_sqs, max_exp_avg_sqs, counters)
    scale = torch.tensor(inv_scale) if inv_scale is not None else None

    def step(_):
        expected_params, expected = reference_adam(
            params, grads, state, inv_scale, {**options, **hyper}
        )
        kernels.adam_(
            params,
            grads,
            state.exp_avgs,
            state.exp_avg_sqs,
            state.max_exp_avg_sqs,
            state.steps,
            **options,
            **hyper,
            found_inf=torch.zeros(()),
            inv_scale=scale,
        )
        for name in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            for actual, reference in zip(getattr(state, name), getattr(expected, name)):
                assert_state_close(actual, reference)
        assert [s.item() for s in state.steps] == [s.item() for s in expected.steps]
        return expected_params

    compare_steps(params, grads, steps, torch.Generator().manual_seed(seed), step)


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_torch_every_option_and_dtype(param_dtype, grad_dtype, options):
    generator = torch.Generator().manual_seed(1)
    params, grads = boundary_params_and_grads(param_dtype, grad_dtype, generator)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    run_and_compare(params, grads, options, hyper, inv_scale=0.25)


@settings(max_examples=25, deadline=None)
@given(
    options=st.sampled_from(OPTIONS),
    dtypes=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)), min_size=1, max_size=6
    ),
    sizes=st.lists(st.integers(0, 3 * CHUNK + 7), min_size=6, max_size=6),
    lr=st.floats(1e-4, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.9, 0.9999),
    eps=st.floats(1e-10, 1e-3),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_for_mixed_dtypes_and_hyperparameters(
    options, dtypes, sizes, lr, beta1, beta2, eps, inv_scale, seed
):
    params, grads = mixed_params_and_grads(sizes, dtypes, seed)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    run_and_compare(params, grads, options, hyper, inv_scale, steps=2, seed=seed)
