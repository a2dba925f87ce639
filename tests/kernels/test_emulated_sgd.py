"""Emulated sgd_ against torch.optim.SGD (foreach=False), step by step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import (
    CHUNK,
    DTYPES,
    assert_param_close,
    assert_state_close,
    boundary_params_and_grads,
    compare_steps,
    mixed_params_and_grads,
    reference_sgd,
)

from scaledoptim import kernels

OPTIONS = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=w, maximize=x)
    for m, d, n, w, x in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.1), (False, True)
    )
    if not (m == 0 and (d or n))  # dampening and nesterov only act through momentum
]


def run_and_compare(params, grads, options, lr, inv_scale, steps=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Garbage buffers: the first taken step must overwrite them with the gradient.
    buffers = (
        [torch.randn(p.shape, generator=generator) for p in params] if options["momentum"] else []
    )
    counters = [torch.zeros(()) for _ in params]
    scale = torch.tensor(inv_scale) if inv_scale is not None else None

    def step(i):
        expected_params, expected_buffers = reference_sgd(
            params, grads, buffers, counters, inv_scale, {**options, "lr": lr}
        )
        kernels.sgd_(
            params,
            grads,
            buffers,
            counters,
            **options,
            lr=lr,
            found_inf=torch.zeros(()),
            inv_scale=scale,
        )
        for actual, reference in zip(buffers, expected_buffers):
            assert_state_close(actual, reference)
        assert all(c.item() == i + 1 for c in counters)
        return expected_params

    compare_steps(params, grads, steps, generator, step)


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_torch_every_option_and_dtype(param_dtype, grad_dtype, options):
    generator = torch.Generator().manual_seed(1)
    params, grads = boundary_params_and_grads(param_dtype, grad_dtype, generator)
    run_and_compare(params, grads, options, lr=0.05, inv_scale=0.25)


@settings(max_examples=25, deadline=None)
@given(
    options=st.sampled_from(OPTIONS),
    dtypes=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)), min_size=1, max_size=6
    ),
    sizes=st.lists(st.integers(0, 3 * CHUNK + 7), min_size=6, max_size=6),
    lr=st.floats(1e-4, 1.0),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_for_mixed_dtypes_and_hyperparameters(
    options, dtypes, sizes, lr, inv_scale, seed
):
    params, grads = mixed_params_and_grads(sizes, dtypes, seed)
    run_and_compare(params, grads, options, lr, inv_scale, steps=2, seed=seed)


@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_update_that_nearly_cancels_the_param_keeps_torchs_fused_rounding(param_dtype):
    """p - lr * g with g == p and lr close to 1: computed with separate roundings the update
    lands 2 fp16 ulps from torch (found by hypothesis); one fmaf, as torch does, keeps it."""
    params, grads = mixed_params_and_grads([115], [(param_dtype, torch.float16)], seed=1)
    grads[0].copy_(params[0])
    expected, _ = reference_sgd(params, grads, [], [torch.zeros(())], None, dict(OPTIONS[0], lr=0.99999))
    kernels.sgd_(params, grads, [], [torch.zeros(())], **OPTIONS[0], lr=0.99999, found_inf=None, inv_scale=None)
    assert_param_close(params[0], expected[0])
