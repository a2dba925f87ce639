"""The no-closure unscale_and_step never reads a tensor on the host (patched to raise), for every
generic config of every fused row."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.sync_free import HostRead, no_host_reads
from scaledoptim.testing.optim_db import OptimInfo, rows
from tests.support.cases import Cases
from tests.support.training import loss_of, make_model

pytestmark = pytest.mark.usefixtures("kernel_backend")

ROWS = [pytest.param(info, id=info.name) for info in rows(fused=True)]


def test_the_patch_catches_host_reads() -> None:
    with no_host_reads(), pytest.raises(HostRead, match=r"Tensor\.__bool__"):
        bool(torch.ones(()))


def _steps_without_host_reads(
    opt: scaledoptim.Optimizer, model: torch.nn.Module, overflow: bool, **kwargs: object
) -> torch.Tensor:
    """Three steps, each ``unscale_and_step(**kwargs)`` under the patch; the last ``found_inf``."""
    S = opt.scale
    for step in range(3):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), S).backward()
        if overflow:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        with no_host_reads():
            _, found_inf, S = opt.unscale_and_step(
                grads_scaled_by=S, **kwargs  # type: ignore[arg-type]
            )
    return found_inf


@pytest.mark.parametrize("info", ROWS)
def test_unscale_and_step_performs_no_host_read(info: OptimInfo) -> None:
    """Each generic config x a clean and an overflowing step (one item per row and backend, each
    failing case named)."""
    cases = Cases()
    for config in info.generic_configs:
        for overflow in (False, True):
            with cases.case(f"{config.name}, overflow={overflow}"):
                model = make_model()
                opt = info.make(model.parameters(), config)
                found_inf = _steps_without_host_reads(opt, model, overflow)
                assert found_inf.item() == float(overflow)
    cases.assert_all_passed()


@pytest.mark.parametrize("info", ROWS)
def test_clipping_in_the_step_performs_no_host_read(info: OptimInfo) -> None:
    """``max_grad_norm``: the norm, its agreement and the clip factor stay on device (a clean
    and an overflowing step, each failing one named)."""
    cases = Cases()
    for overflow in (False, True):
        with cases.case(f"overflow={overflow}"):
            model = make_model()
            opt = info.make(model.parameters())
            found_inf = _steps_without_host_reads(opt, model, overflow, max_grad_norm=0.01)
            assert found_inf.item() == float(overflow)
            norm = opt.grad_norm  # (read after the patch: computed on device during the step)
            assert norm is not None and norm.isfinite().item() != overflow
    cases.assert_all_passed()


def test_python_float_scale_is_sync_free_too() -> None:
    model = make_model()
    opt = scaledoptim.AdamW(model.parameters())
    scaledoptim.scale_outputs(loss_of(model, 0), 1024.0).backward()
    with no_host_reads():
        opt.unscale_and_step(grads_scaled_by=1024.0)
