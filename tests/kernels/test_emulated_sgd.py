"""Emulated sgd_ against torch.optim.SGD (foreach=False), step by step."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import (
    CHUNK,
    assert_param_close,
    assert_state_close,
    make_tensors,
    reference_sgd,
    test_sizes,
)

from scaledoptim import kernels

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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
    for step in range(steps):
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=generator).to(g.dtype))
        grads_before = [g.clone() for g in grads]
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
        for actual, reference in zip(params, expected_params):
            assert_param_close(actual, reference)
        for actual, reference in zip(buffers, expected_buffers):
            assert_state_close(actual, reference)
        assert all(c.item() == step + 1 for c in counters)
        for g, before in zip(grads, grads_before):
            assert torch.equal(g.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_torch_every_option_and_dtype(param_dtype, grad_dtype, options):
    generator = torch.Generator().manual_seed(1)
    sizes = test_sizes(CHUNK)
    params = make_tensors(sizes, param_dtype, generator)
    grads = make_tensors(sizes, grad_dtype, generator)
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
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=generator).to(p) for n, (p, _) in zip(sizes, dtypes)]
    grads = [torch.randn(n, generator=generator).to(g) for n, (_, g) in zip(sizes, dtypes)]
    run_and_compare(params, grads, options, lr, inv_scale, steps=2, seed=seed)
