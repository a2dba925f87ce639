"""The bf16 stall: AdamW's lr 1e-4 updates are below half a bf16 ulp of |p| ~ 1, so plain
round-to-nearest never moves the params; master weights and stochastic rounding do."""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

STEPS, N = 1000, 32768


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
    start, fp32, _ = _train(torch.float32)
    fp32_displacement = (fp32 - start).mean().item()
    assert fp32_displacement < -0.09  # about lr * STEPS

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
    assert abs(displacement - fp32_displacement) <= 0.02 * abs(fp32_displacement), (
        displacement,
        fp32_displacement,
    )
