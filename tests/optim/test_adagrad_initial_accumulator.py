"""Adagrad's ``sum`` starts where torch.optim.Adagrad (2.13) starts it: at the constructor's
``initial_accumulator_value`` for every param, whatever a group dict says (constructor or
``add_param_group``), and again after a param's state is cleared or dropped from a loaded
state_dict. A group's own value is kept in the group, unchecked, as torch keeps it."""

from __future__ import annotations

import copy

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        for shape in ((4, 3), (3,), (5,))
    ]


def _grads(params, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def _run(module, dtype: torch.dtype = torch.float32):
    """Per-group values in a constructor group and an added group; a cleared state; a load
    whose state lacks one param's entry."""
    a, b, c = _params(dtype)
    opt = module.Adagrad(
        [{"params": [a]}, {"params": [b], "initial_accumulator_value": 5.0}],
        lr=0.1, initial_accumulator_value=0.25,
    )
    opt.add_param_group({"params": [c], "initial_accumulator_value": -3.0})  # unused, unchecked
    trajectory = []
    for step in range(6):
        if step == 2:
            opt.state[a].clear()
        if step == 4:
            state_dict = copy.deepcopy(opt.state_dict())
            del state_dict["state"][1]
            opt.load_state_dict(state_dict)
        _grads((a, b, c), step)
        opt.step()
        trajectory.append([p.detach().clone() for p in (a, b, c)])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return trajectory, groups, [opt.state[p]["sum"] for p in (a, b, c)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=str)
def test_every_sum_starts_at_the_constructors_value_as_in_torch_optim(dtype) -> None:
    expected, expected_groups, expected_sums = _run(torch.optim, dtype)
    actual, groups, sums = _run(scaledoptim, dtype)
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(sums, expected_sums)
    assert [g["initial_accumulator_value"] for g in groups] == [
        g["initial_accumulator_value"] for g in expected_groups
    ] == [0.25, 5.0, -3.0]


def test_the_constructors_value_is_checked_as_torch_checks_it() -> None:
    for module in (torch.optim, scaledoptim):
        with pytest.raises(ValueError, match="Invalid initial_accumulator_value value: -1"):
            module.Adagrad(_params(), initial_accumulator_value=-1.0)
