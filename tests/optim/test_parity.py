"""Trajectory parity with torch.amp.GradScaler("cpu") + each row's reference (the torch.optim
class, or the optimizer's own torch form in float64), on both backends.

Runs every generic config of every row whose ``step()`` takes no closure (the sweep of configs
is the kernel tests' business: tests/kernels/test_emulated_parity.py).
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import Config, OptimInfo, rows
from tests.support.references import reference_optimizer
from tests.support.training import loss_of, make_model

pytestmark = pytest.mark.usefixtures("kernel_backend")

STEPS = 14
OVERFLOW_AT = {0: float("inf"), 4: float("nan"), 5: float("-inf"), 11: float("inf")}
GROWTH_INTERVAL = 3
CONFIGS = [
    pytest.param(info, config, id=f"{info.name}-{config.name}")
    for info in rows(closure=False)
    for config in info.generic_configs
]


def _inject(model: torch.nn.Module, step: int) -> None:
    if step in OVERFLOW_AT:
        param = list(model.parameters())[step % 4]
        param.grad.view(-1)[step % param.numel()] = OVERFLOW_AT[step]


@pytest.mark.parametrize(("info", "config"), CONFIGS)
@pytest.mark.parametrize("form", ["unscale_and_step", "unscale+step_after_unscale"])
def test_trajectory_matches_gradscaler(info: OptimInfo, config: Config, form: str) -> None:
    ref_model, model = make_model(), make_model()
    ref_opt = reference_optimizer(info, ref_model.parameters(), config)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    opt = info.make(model.parameters(), config).configure_scaling(
        init_scale=2.0**10, growth_interval=GROWTH_INTERVAL
    )
    S, tolerance = opt.scale, info.tolerance
    skipped = 0
    for step in range(STEPS):
        ref_opt.zero_grad()
        scaler.scale(loss_of(ref_model, step)).backward()
        _inject(ref_model, step)
        scaler.step(ref_opt)
        scaler.update()

        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), S).backward()
        _inject(model, step)
        if form == "unscale_and_step":
            _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
        else:
            found_inf, S = opt.unscale(grads_scaled_by=S)
            opt.step_after_unscale()
        skipped += int(found_inf.item())

        assert S.item() == scaler.get_scale(), f"scale differs after step {step}"
        for ref_p, p in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(
                p,
                ref_p,
                rtol=tolerance.trajectory_rtol,
                atol=tolerance.trajectory_atol,
                msg=f"step {step}",
            )
    assert skipped == len(OVERFLOW_AT)


@pytest.mark.parametrize(("info", "config"), CONFIGS)
def test_plain_step_matches_the_reference(info: OptimInfo, config: Config) -> None:
    """Without scaling, ``step()`` is the reference's step."""
    ref_model, model = make_model(), make_model()
    ref_opt = reference_optimizer(info, ref_model.parameters(), config)
    opt, tolerance = info.make(model.parameters(), config), info.tolerance
    for step in range(5):
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, step).backward()
            o.step()
        for ref_p, p in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(
                p, ref_p, rtol=tolerance.trajectory_rtol, atol=tolerance.trajectory_atol
            )
