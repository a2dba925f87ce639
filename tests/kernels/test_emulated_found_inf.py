"""Note [found_inf contract]: a non-zero found_inf leaves every byte of the step untouched."""

from __future__ import annotations

import pytest
import torch
from kernel_reference import (
    adam_options,
    assert_bytes_unchanged,
    boundary_params_and_grads,
    sgd_options,
    snapshot,
)

from scaledoptim import kernels

SKIP_FLAGS = (1.0, 2.0, -1.0, float("nan"), float("inf"))


def adam_tensors(dtype):
    generator = torch.Generator().manual_seed(0)
    params, grads = boundary_params_and_grads(dtype, dtype, generator)
    state = [[torch.rand(p.shape, generator=generator) for p in params] for _ in range(3)]
    steps = [torch.full((), 7.0) for _ in params]
    return params, grads, state, steps


@pytest.mark.parametrize("flag", SKIP_FLAGS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("decoupled", (False, True))
def test_adam_skips_on_nonzero_found_inf(flag, dtype, decoupled):
    params, grads, (m, v, v_max), steps = adam_tensors(dtype)
    everything = [*params, *grads, *m, *v, *v_max, *steps]
    before = snapshot(everything)
    kernels.adam_(
        params,
        grads,
        m,
        v,
        v_max,
        steps,
        **adam_options(lr=0.1, weight_decay=0.1, decoupled_weight_decay=decoupled, amsgrad=True),
        found_inf=torch.tensor(flag),
        inv_scale=torch.tensor(0.5),
    )
    assert_bytes_unchanged(before, everything)


@pytest.mark.parametrize("flag", SKIP_FLAGS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_sgd_skips_on_nonzero_found_inf(flag, dtype):
    params, grads, (buffers, _, _), steps = adam_tensors(dtype)
    everything = [*params, *grads, *buffers, *steps]
    before = snapshot(everything)
    kernels.sgd_(
        params,
        grads,
        buffers,
        steps,
        **sgd_options(nesterov=True, weight_decay=0.1),
        found_inf=torch.tensor(flag),
        inv_scale=torch.tensor(0.5),
    )
    assert_bytes_unchanged(before, everything)


def test_zero_found_inf_steps_and_advances_counters():
    params, grads, (m, v, _), steps = adam_tensors(torch.float32)
    before = snapshot(params)
    kernels.adam_(
        params,
        grads,
        m,
        v,
        [],
        steps,
        **adam_options(lr=0.1, weight_decay=0.0),
        found_inf=torch.zeros(()),
        inv_scale=None,
    )
    assert all(s.item() == 8.0 for s in steps)
    assert all(not torch.equal(b, p) for b, p in zip(before, params) if p.numel())
