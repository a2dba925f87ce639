"""The bf16 stall: AdamW's lr 1e-4 updates are below half a bf16 ulp of |p| ~ 1, so plain
round-to-nearest never moves the params; master weights and stochastic rounding do."""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

# Sized by what it must tell apart: stochastic rounding's mean drift is fp32's within 5% (a
# biased rounding, e.g. 15 bits of noise instead of 16, is off by far more), at 4 sigma of the
# rounding noise of STEPS x N draws.
STEPS, N = 400, 16384


def _train(dtype: torch.dtype, **rounding) -> tuple[torch.Tensor, torch.Tensor, scaledoptim.AdamW]:
    gen = torch.Generator().manual_seed(0)
    start = (1.25 + 0.5 * torch.rand(N, generator=gen)).to(torch.bfloat16)  # bf16 ulp 2**-7 here
    grad = 0.5 + torch.rand(N, generator=gen)  # fixed and positive: every param moves down
    param = torch.nn.Parameter(start.to(dtype))
    opt = scaledoptim.AdamW([param], lr=1e-4, **rounding)
    param.grad = grad.to(dtype)
    for _ in range(STEPS):
        opt.step()
    return start.float(), param.detach(), opt


def test_round_to_nearest_stalls_and_both_options_follow_fp32() -> None:
    """Exists for the rounding options over many steps: master weights that are not stored
    (mutant master-weights-not-stored), stochastic rounding with biased noise
    (stochastic-rounding-half-noise), and round-to-nearest that would move a stalled param."""
    start, fp32, _ = _train(torch.float32)
    fp32_displacement = (fp32 - start).mean().item()
    assert fp32_displacement < -0.9 * 1e-4 * STEPS  # about lr * STEPS

    _, nearest, _ = _train(torch.bfloat16)
    assert torch.equal(nearest.float(), start), "round-to-nearest moved a param"

    _, mastered, opt = _train(torch.bfloat16, master_weights=True)
    master = next(iter(opt.state.values()))["master_param"]
    assert torch.equal(master.view(torch.int32), fp32.view(torch.int32)), (
        "master differs from the fp32 run"
    )
    assert torch.equal(mastered, fp32.to(torch.bfloat16))

    _, stochastic, _ = _train(torch.bfloat16, stochastic_rounding=True)
    displacement = (stochastic.float() - start).mean().item()
    assert abs(displacement - fp32_displacement) <= 0.05 * abs(fp32_displacement), (
        displacement,
        fp32_displacement,
    )
