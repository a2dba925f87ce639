"""The AdamW loops the doctor's ``step-time`` and ``clip-step-time`` checks (and the CUDA
benchmark's baseline) time, run on a CPU: GradScaler's loop runs (its ``step`` needs the scale a
scaled backward creates) and moves the params as ours does, with and without clipping, and the
checks report both times."""

from __future__ import annotations

import re

import pytest
import torch

from scaledoptim.doctor import performance
from scaledoptim.doctor.adamw_loops import SCALE, gradscaler_loop, scaledoptim_loop

CPU = torch.device("cpu")
SIZES = [1000, 37]


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip"])
def test_our_loop_and_gradscalers_step_the_params_alike(clip: bool) -> None:
    ours, theirs = scaledoptim_loop(SIZES, CPU, clip), gradscaler_loop(SIZES, CPU, clip)
    start = [p.detach().clone() for p in theirs.params]
    for ours_p, theirs_p in zip(ours.params, theirs.params):
        assert torch.equal(ours_p, theirs_p) and torch.equal(ours_p.grad, theirs_p.grad)
    for _ in range(3):
        ours.step()
        theirs.step()
    for ours_p, theirs_p, before in zip(ours.params, theirs.params, start):
        assert not torch.equal(theirs_p, before)  # the baseline stepped
        torch.testing.assert_close(ours_p, theirs_p, rtol=1e-5, atol=1e-6)


def test_a_clipping_loop_restores_the_scaled_grads_it_unscaled() -> None:
    loop = gradscaler_loop(SIZES, CPU, clip=True)
    scaled = [p.grad.clone() for p in loop.params]
    loop.step()
    assert all(not torch.equal(p.grad, g) for p, g in zip(loop.params, scaled))
    loop.restore()
    assert all(torch.equal(p.grad, g) for p, g in zip(loop.params, scaled))
    assert loop.params[0].grad.abs().max() > SCALE / 100  # scaled, as a scaled backward left them


@pytest.mark.parametrize("check", [performance.step_time, performance.clip_step_time])
def test_the_step_time_checks_time_both_loops(check) -> None:
    outcome = check(CPU, n_params=4096)  # times, not asserted: a CPU's say nothing of a GPU's
    assert not outcome.skipped
    assert re.match(r"-?\d+\.\d{3} ms vs -?\d+\.\d{3} ms \(-?\d+\.\d{2}x\)", outcome.detail)
    assert "GradScaler" in outcome.detail and "4096 fp32 params" in outcome.detail


@pytest.mark.parametrize("check", [performance.bandwidth, performance.clip_bandwidth])
def test_the_bandwidth_checks_time_the_step_with_and_without_clipping(check) -> None:
    outcome = check(CPU, n_params=4096)  # the CPU twin of the GPU check: it runs, not how fast
    assert not outcome.skipped
    assert re.match(r"-?\d+ GB/s at 32 B/param = -?\d+\.\d{2} of copy", outcome.detail)
    clipping = "max_grad_norm=1.0" in outcome.detail
    assert clipping == (check is performance.clip_bandwidth)

