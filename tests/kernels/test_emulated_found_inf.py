"""Note [found_inf contract]: a non-zero found_inf leaves every byte of an update kernel's step
untouched (its counters included), for every update kernel of KERNEL_CASES and every option."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_reference import (
    DTYPES,
    assert_bytes_unchanged,
    boundary_params_and_grads,
    snapshot,
)
from tests.kernels.kernel_table import CASE_OPTIONS, UPDATE_CASES, case_id, launch_case

SKIP_FLAGS = (1.0, 2.0, -1.0, float("nan"), float("inf"))


def lists_mid_training(case, options, dtype):
    """The case's lists with random state (scratch left zero) and every counter at 7 (not a first step)."""
    generator = torch.Generator().manual_seed(0)
    params, grads = boundary_params_and_grads(dtype, dtype, generator)
    lists = case.make_lists(params, grads, options, generator)
    for t in (t for ts in case.state(lists) for t in ts):
        t.copy_(torch.rand(t.shape, generator=generator))
    for s in lists[-1]:
        s.fill_(7.0)
    return lists


@pytest.mark.parametrize(("case", "options"), CASE_OPTIONS)
def test_nonzero_found_inf_leaves_every_byte_alone(case, options):
    # The param/grad dtype cycles with the option, so each kernel meets every flag in every
    # dtype (an emulated launch costs a millisecond even when skipped).
    dtype = DTYPES[case.all_options().index(options) % len(DTYPES)]
    lists = lists_mid_training(case, options, dtype)
    everything = [t for ts in lists for t in ts]
    before = snapshot(everything)
    for flag in SKIP_FLAGS:  # each launch is skipped, so every flag sees the same tensors
        launch_case(case, lists, options, torch.tensor(flag), torch.tensor(0.5))
        assert_bytes_unchanged(before, everything)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_id)
def test_zero_found_inf_steps_and_advances_counters(case):
    for options in case.all_options():
        lists = lists_mid_training(case, options, torch.float32)
        params, steps = lists[0], lists[-1]
        before = snapshot(params)
        launch_case(case, lists, options, torch.zeros(()), None)
        assert all(s.item() == 8.0 for s in steps)
        assert all(not torch.equal(b, p) for b, p in zip(before, params) if p.numel())
