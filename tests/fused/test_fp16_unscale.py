"""fp16 grads are unscaled in fp32 (or checked after unscaling): never NaN params behind a clean
found_inf, never a small true grad flushed to zero before the update."""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _fp16_param(value: float, grad: float) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.full((8,), value, dtype=torch.float16))
    param.grad = torch.full((8,), grad, dtype=torch.float16)
    return param


@pytest.mark.parametrize("optimizer", [scaledoptim.AdamW, scaledoptim.SGD])
def test_a_scale_below_one_never_turns_params_nan_behind_a_clean_found_inf(optimizer) -> None:
    """Scaled by 0.5, a true grad of 120000 is 60000 in fp16: finite. Unscaled in fp16 it would
    be inf after torch's check (found_inf 0, params NaN)."""
    # (unscale() refuses fp16 grads: tests/protocol/test_unscale_fp16_grads.py.)
    for form in ("unscale_and_step",):
        param = _fp16_param(1.0, 60000.0)
        opt = optimizer([param], lr=1e-3).configure_scaling(init_scale=0.5, min_scale=2.0**-8)
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
        assert torch.isfinite(param).all(), form
        # Either the update used the true grad (in fp32), or the overflow was seen and skipped.
        moved = not torch.equal(param.detach(), torch.ones(8, dtype=torch.float16))
        assert moved != bool(found_inf.item()), form


def test_a_small_true_grad_moves_an_fp16_param_as_in_fp32() -> None:
    """1e-8 scaled by 65536 is 6.6e-4 in fp16; unscaled in fp16 it would be 0 and Adam would not
    move. torch's fused GradScaler path moves the param by ~lr; so must we."""
    param = _fp16_param(1.0, 1e-8 * 65536)
    reference = torch.nn.Parameter(torch.ones(8))
    reference.grad = param.grad.float() / 65536
    opt = scaledoptim.AdamW([param], lr=5e-3, weight_decay=0.0)
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    torch.optim.AdamW([reference], lr=5e-3, weight_decay=0.0).step()
    assert param[0].item() < 1.0
    expected = reference.detach().to(torch.float16)
    assert (param.detach().float() - expected.float()).abs().max().item() <= 2.0**-10  # one ulp
