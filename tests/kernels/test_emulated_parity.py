"""Every fused row of optim_db on the emulated kernels against the row's reference
(``torch.optim``'s class, or the optimizer's own torch form in float64), step by step, launched
as the kernel backend launches it (tests/support/launches.py).

Every config of every row (the sweep: a config is a few emulated launches) in every param x grad
dtype pair, on boundary sizes and misaligned views; mixed dtypes and hyper-parameters drawn from
the row's ranges by hypothesis; and the launches against a step of the optimizer itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim.testing.optim_db import OptimInfo, rows
from tests.support.launches import check_parity, row_update
from tests.support.tensors import (
    CHUNK,
    DTYPES,
    assert_bytes_unchanged,
    boundary_params_and_grads,
    misaligned,
    mixed_params_and_grads,
)

CONFIGS = [
    pytest.param(info, config, id=f"{info.name}-{config.name}")
    for info in rows(fused=True)
    for config in info.configs
]


def hyperparameters(info: OptimInfo) -> st.SearchStrategy[dict[str, Any]]:
    """The float options of the row's ranges: ``(low, high)``, or a tuple of those (betas)."""

    def floats(bounds: tuple[Any, ...]) -> st.SearchStrategy[Any]:
        if isinstance(bounds[0], tuple):
            return st.tuples(*(st.floats(low, high) for low, high in bounds))
        return st.floats(*bounds)

    return st.fixed_dictionaries({key: floats(bounds) for key, bounds in info.ranges.items()})


@pytest.mark.parametrize(("info", "config"), CONFIGS)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_matches_reference_every_config_and_dtype(param_dtype, grad_dtype, info, config):
    generator = torch.Generator().manual_seed(1)
    params, grads = boundary_params_and_grads(param_dtype, grad_dtype, generator)
    check_parity(info, config, params, grads, inv_scale=0.25)


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    sizes=st.lists(st.integers(0, 3 * CHUNK + 7), min_size=6, max_size=6),
    inv_scale=st.one_of(st.none(), st.sampled_from([2.0**-16, 0.5, 1.0])),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_for_mixed_dtypes_and_hyperparameters(info, data, sizes, inv_scale, seed):
    param_dtypes = st.sampled_from(info.mixed_param_dtypes)
    dtypes = data.draw(
        st.lists(st.tuples(param_dtypes, st.sampled_from(DTYPES)), min_size=1, max_size=6),
        label="dtypes",
    )
    config = data.draw(st.sampled_from(info.configs), label="config")
    changes = data.draw(hyperparameters(info), label="hyper")
    params, grads = mixed_params_and_grads(sizes, dtypes, seed)
    check_parity(info, config, params, grads, inv_scale, n_steps=2, seed=seed, **changes)


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_the_launches_here_are_what_a_step_of_the_optimizer_launches(info, monkeypatch):
    """The kernel tests launch a row's update from the optimizer's own planning hooks
    (tests/support/launches.py): a step of the optimizer on the emulator writes the same bytes."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    for config in info.configs:
        generator = torch.Generator().manual_seed(2)
        params, grads = boundary_params_and_grads(torch.bfloat16, torch.bfloat16, generator)
        # Copies aligned as the originals: a reduction (LAMB's norms) sums vector lanes in an
        # order that depends on the alignment.
        copies = [misaligned(p) if p.storage_offset() else p.clone() for p in params]
        ours = row_update(info, params, grads, config)
        ours.launch(torch.zeros(()), torch.tensor(0.5))
        opt = info.make(copies, config)
        for p, g in zip(copies, grads):
            p.grad = g.clone()
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=2.0)
        assert found_inf.item() == 0
        assert_bytes_unchanged(copies, ours.params)
        theirs = [opt.state[p] for p in copies]
        for state, expected in zip(theirs, ours.state_dicts()):
            assert_bytes_unchanged([state[key] for key in expected], list(expected.values()))
