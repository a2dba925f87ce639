"""See Note [found_inf contract]: a non-zero found_inf leaves every byte of an update's step
untouched (its counters included), for every fused row of optim_db and every config of it, launched
as the kernel backend launches it; a zero found_inf steps and advances every counter."""

from __future__ import annotations

import pytest
import torch

from scaledoptim.testing.optim_db import Config, OptimInfo, rows
from tests.support.cases import Cases
from tests.support.launches import RowUpdate, row_update
from tests.support.tensors import DTYPES, assert_bytes_unchanged, boundary_params_and_grads, clones

SKIP_FLAGS = (1.0, 2.0, -1.0, float("nan"), float("inf"))


def mid_training(info: OptimInfo, config: Config, dtype: torch.dtype) -> RowUpdate:
    """The row's update with random state (scratch left zero) and every counter at 7 (not a
    first step)."""
    generator = torch.Generator().manual_seed(0)
    params, grads = boundary_params_and_grads(dtype, dtype, generator)
    update = row_update(info, params, grads, config)
    for t in (t for ts in update.state for t in ts):
        t.copy_(torch.rand(t.shape, generator=generator))
    for s in update.steps:
        s.fill_(7.0)
    return update


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_nonzero_found_inf_leaves_every_byte_alone(info):
    """Each config of the row (one item per row, each failing config named with its dtype)."""
    cases = Cases()
    for index, config in enumerate(info.configs):
        # The param/grad dtype cycles with the config, so each kernel meets every flag in every
        # dtype (an emulated launch costs a millisecond even when skipped).
        dtype = DTYPES[index % len(DTYPES)]
        with cases.case(f"{config.name}, {dtype}"):
            update = mid_training(info, config, dtype)
            before = clones(update.tensors)
            for flag in SKIP_FLAGS:  # each launch is skipped, so every flag sees the same tensors
                update.launch(torch.tensor(flag), torch.tensor(0.5))
                assert_bytes_unchanged(before, update.tensors)
    cases.assert_all_passed()


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_zero_found_inf_steps_and_advances_counters(info):
    for config in info.configs:
        update = mid_training(info, config, torch.float32)
        before = clones(update.params)
        update.launch(torch.zeros(()), None)
        assert all(s.item() == 8.0 for s in update.steps)
        assert all(not torch.equal(b, p) for b, p in zip(before, update.params) if p.numel())
