"""Every emulated update kernel of KERNEL_CASES against its torch.optim reference (foreach=False),
step by step: every option of its grid, every param x grad dtype, boundary sizes and misaligned
views; mixed dtypes and hyper-parameters by hypothesis."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.kernel_reference import (
    CHUNK,
    DTYPES,
    assert_bytes_unchanged,
    boundary_params_and_grads,
    misaligned,
    mixed_params_and_grads,
)
from tests.kernels.kernel_table import (
    CASE_OPTIONS,
    UPDATE_CASES,
    case_id,
    check_parity,
    launch_case,
)


def test_update_rows_are_well_formed():
    for case in UPDATE_CASES:
        kernel = case.kernel
        assert kernel.lists[:2] == ("params", "grads") and kernel.lists[-1] == "steps", kernel
        assert kernel.dtype_lists == (0, 1) and kernel.per_tensor_lists[-1] == kernel.n_lists - 1
        assert case.reference is not None and case.functional is not None and case.grid
        for options in case.all_options():
            lists = case.make_lists([torch.ones(2)], [torch.ones(2)], options, torch.Generator())
            assert len(lists) == kernel.n_lists


@pytest.mark.parametrize(("case", "options"), CASE_OPTIONS)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_reference_every_option_and_dtype(param_dtype, grad_dtype, case, options):
    generator = torch.Generator().manual_seed(1)
    params, grads = boundary_params_and_grads(param_dtype, grad_dtype, generator)
    check_parity(case, params, grads, options, inv_scale=0.25)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_id)
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    sizes=st.lists(st.integers(0, 3 * CHUNK + 7), min_size=6, max_size=6),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_for_mixed_dtypes_and_hyperparameters(
    case, data, sizes, inv_scale, seed
):
    param_dtypes = st.sampled_from(case.mixed_param_dtypes)
    dtypes = data.draw(
        st.lists(st.tuples(param_dtypes, st.sampled_from(DTYPES)), min_size=1, max_size=6),
        label="dtypes",
    )
    options = case.options(
        **data.draw(st.sampled_from(case.grid), label="options"),
        **data.draw(st.fixed_dictionaries(case.hyper), label="hyper"),
    )
    params, grads = mixed_params_and_grads(sizes, dtypes, seed)
    check_parity(case, params, grads, options, inv_scale, n_steps=2, seed=seed)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_id)
def test_the_functional_entry_point_is_the_table_launch(case):
    """``kernels.xxx_(*lists, ...)`` launches exactly what the optimizer's path does."""
    for options in case.all_options():
        generator = torch.Generator().manual_seed(2)
        params, grads = boundary_params_and_grads(torch.bfloat16, torch.float16, generator)
        ours = case.make_lists(params, grads, options, generator)
        # Copies aligned as the originals: a reduction (LAMB's norms) sums vector lanes in an
        # order that depends on the alignment.
        theirs = [[misaligned(t) if t.storage_offset() else t.clone() for t in ts] for ts in ours]
        found_inf, inv_scale = torch.zeros(()), torch.tensor(0.5)
        launch_case(case, ours, options, found_inf, inv_scale)
        case.functional(*theirs, found_inf=found_inf, inv_scale=inv_scale, **options)
        assert_bytes_unchanged([t for ts in theirs for t in ts], [t for ts in ours for t in ts])
