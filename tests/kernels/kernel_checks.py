"""Launching a KERNEL_CASES row as the optimizer does, and its parity check against the row's
reference (kernel_table.py re-exports both)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from scaledoptim import kernels
from tests.kernels.kernel_reference import (
    assert_bytes_unchanged,
    assert_param_close,
    assert_state_close,
    snapshot,
)

if TYPE_CHECKING:
    from tests.kernels.kernel_table import KernelCase


@dataclass(frozen=True)
class Tolerance:
    """Of a kernel's result against its fp32 reference (16-bit params: always one ulp)."""

    param_rtol: float = 1e-6
    param_atol: float = 1e-6
    state_rtol: float = 1e-6
    state_atol: float = 1e-7


def pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def launch_case(
    case: KernelCase,
    lists: Sequence[Sequence[Tensor]],
    options: dict,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
) -> None:
    """Launches ``case.kernel`` on ``lists`` as the optimizer does: both launches of an update
    kernel (the update, then STEP_EPILOGUE advancing its last list) validated before either runs."""
    if case.prepare is not None:
        run = case.prepare(lists)
    else:
        launch = kernels.prepare_launch(case.kernel, lists)
        run = lambda o, f, i: launch.run(case.args(f, i, **o))
    advance = kernels.prepare_launch(kernels.STEP_EPILOGUE, [lists[-1]]) if case.update else None
    run(options, pointer(found_inf), pointer(inv_scale))
    if advance is not None:
        advance.run(kernels.StepEpilogueArgs(found_inf=pointer(found_inf)))


def check_parity(
    case: KernelCase,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    options: dict,
    inv_scale: float | None,
    n_steps: int = 3,
    seed: int = 0,
    tolerance: Tolerance | None = None,
) -> None:
    """Runs ``n_steps`` update steps of ``case``, each on fresh gradients, against its reference
    started from the kernel's current state (on CPU copies): params, state, counters advanced by
    one, grads never written."""
    generator = torch.Generator().manual_seed(seed)
    lists = case.make_lists(params, grads, options, generator)
    state, steps = case.state(lists), lists[-1]
    tolerance = tolerance or case.tolerance
    device = params[0].device if params else torch.device("cpu")
    scale = torch.tensor(inv_scale, device=device) if inv_scale is not None else None
    for i in range(n_steps):
        for g in grads:  # fresh gradients every step
            g.copy_(torch.randn(g.shape, generator=generator).to(g.dtype))
        grads_before = snapshot(grads)
        expected_params, expected_state = case.reference(
            *([t.cpu() for t in ts] for ts in (params, grads)),
            [[t.cpu() for t in ts] for ts in state],
            [s.cpu() for s in steps],
            inv_scale,
            options,
        )
        launch_case(case, lists, options, torch.zeros((), device=device), scale)
        for actual_list, expected_list in zip(state, expected_state, strict=True):
            for actual, expected in zip(actual_list, expected_list, strict=True):
                assert_state_close(
                    actual.cpu(), expected, tolerance.state_rtol, tolerance.state_atol
                )
        assert all(s.item() == i + 1 for s in steps)
        for actual, expected in zip(params, expected_params):
            assert_param_close(actual.cpu(), expected, tolerance.param_rtol, tolerance.param_atol)
        assert_bytes_unchanged(grads_before, grads)  # update kernels never write grads
