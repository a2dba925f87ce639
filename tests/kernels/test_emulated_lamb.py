"""Emulated lamb_ (three launches: global grad norm, moments and norms, update) against the
float64 formula of Apex FusedLAMB (kernel_reference.reference_lamb), step by step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import (
    CHUNK,
    DTYPES,
    assert_bytes_unchanged,
    boundary_params_and_grads,
    compare_steps,
    lamb_options,
    mixed_params_and_grads,
    reference_lamb,
    snapshot,
)

from scaledoptim import kernels

# Everything a kernel table row needs: the kernels, their options grid, the reference.
CASE = dict(
    kernels=(kernels.LAMB_GRAD_NORM, kernels.LAMB_NORMS, kernels.LAMB),
    launch=kernels.lamb_,
    options=[
        lamb_options(
            weight_decay=w,
            adam_w_mode=a,
            grad_averaging=ga,
            use_nvlamb=n,
            max_grad_norm=c,
            bias_correction=b,
        )  # fmt: skip
        for w, a, ga, n, c, b in [
            (0.01, True, True, False, 1.0, True),
            (0.0, True, True, False, 1.0, True),  # no trust ratio
            (0.0, True, False, True, 0.5, True),
            (0.1, False, True, False, 0.0, False),  # L2, clipping off
            (0.1, True, True, True, 100.0, True),  # norm below the clip
        ]
    ],
    reference=reference_lamb,
)


def run_and_compare(params, grads, options, inv_scale, steps=3, seed=0):
    exp_avgs = [torch.zeros(p.shape) for p in params]
    exp_avg_sqs = [torch.zeros(p.shape) for p in params]
    counters = [torch.zeros(()) for _ in params]
    scale = torch.tensor(inv_scale) if inv_scale is not None else None

    def step(_):
        expected_params, expected_m, expected_v = CASE["reference"](
            params, grads, exp_avgs, exp_avg_sqs, counters, inv_scale, options
        )
        CASE["launch"](params, grads, exp_avgs, exp_avg_sqs, counters, **options,
                       found_inf=torch.zeros(()), inv_scale=scale)  # fmt: skip
        for actual, reference in zip(exp_avgs + exp_avg_sqs, expected_m + expected_v):
            torch.testing.assert_close(actual, reference.float(), rtol=1e-5, atol=1e-7)
        return [p.float() for p in expected_params]

    compare_steps(params, grads, steps, torch.Generator().manual_seed(seed), step)


@pytest.mark.parametrize("options", CASE["options"], ids=lambda o: f"wd={o['weight_decay']}-w={o['adam_w_mode']}-"
                         f"avg={o['grad_averaging']}-nv={o['use_nvlamb']}-clip={o['max_grad_norm']}")  # fmt: skip
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_the_formula_every_option_and_dtype(param_dtype, grad_dtype, options, monkeypatch):
    # The trust ratio divides norms summed in another order than float64's: fp32 params are
    # held to 2e-6 relative here (16-bit params to one ulp, as everywhere).
    monkeypatch.setattr("kernel_reference.assert_param_close", _assert_param_close_lamb)
    params, grads = boundary_params_and_grads(
        param_dtype, grad_dtype, torch.Generator().manual_seed(1)
    )
    run_and_compare(params, grads, options, inv_scale=0.25)


def _assert_param_close_lamb(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
    else:
        distance = (actual.float() - expected.to(actual.dtype).float()).abs()
        ulp = torch.finfo(actual.dtype).eps * expected.abs().clamp_min(
            torch.finfo(actual.dtype).tiny
        )
        assert (distance <= ulp * 1.01).all()


@settings(max_examples=15, deadline=None)
@given(
    options=st.sampled_from(CASE["options"]),
    dtypes=st.lists(
        st.tuples(st.just(torch.float32), st.sampled_from(DTYPES)), min_size=1, max_size=6
    ),
    sizes=st.lists(st.integers(1, 3 * CHUNK + 7), min_size=6, max_size=6),
    lr=st.floats(1e-4, 1e-1),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_the_formula_for_mixed_sizes_and_hyperparameters(
    options, dtypes, sizes, lr, inv_scale, seed
):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kernel_reference.assert_param_close", _assert_param_close_lamb)
        params, grads = mixed_params_and_grads(sizes, dtypes, seed)
        run_and_compare(params, grads, {**options, "lr": lr}, inv_scale, 2, seed)


def test_skips_on_found_inf_and_leaves_everything_unchanged():
    params, grads = boundary_params_and_grads(
        torch.bfloat16, torch.float32, torch.Generator().manual_seed(2)
    )
    state = [[torch.randn(p.shape).abs() for p in params] for _ in range(2)]
    counters = [torch.zeros(()) for _ in params]
    before = snapshot(params + state[0] + state[1] + counters)
    kernels.lamb_(
        params, grads, *state, counters, **lamb_options(), found_inf=torch.ones(()), inv_scale=None
    )
    assert_bytes_unchanged(before, params + state[0] + state[1] + counters)
