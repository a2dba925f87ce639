"""The unscale of the torch forms and of the split form (scaledoptim/torch_ops/skip.py), where the
protocol tests do not reach: an uncoalesced sparse grad is checked as its rows sum."""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

ROWS = 6


def _embedding_loss(weight: torch.Tensor, step: int, sparse: bool) -> torch.Tensor:
    """A loss of an embedding whose index repeats row 2 (an uncoalesced sparse grad): at step 1
    each occurrence's grad is finite but their sum is past float32's (and bfloat16's) range,
    scaled (by 1) and unscaled."""
    index = torch.tensor([2, 4, 2])
    size = 2e38 if step == 1 else 0.5
    outputs = torch.full((3, weight.shape[1]), size, dtype=weight.dtype)
    return (torch.nn.functional.embedding(index, weight, sparse=sparse) * outputs).sum()


@pytest.mark.parametrize("form", ["split", "unscale_and_step"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_an_uncoalesced_sparse_grad_is_checked_as_its_rows_sum(dtype, form) -> None:
    """``unscale()`` + ``step_after_unscale()``, or ``unscale_and_step``, on an embedding's
    sparse grad against ``torch.optim.SGD`` + ``GradScaler`` on the dense embedding, whose grad
    holds the sums: where two finite values of one row sum to inf, the step is skipped and the
    scale backs off, as on the dense grad; finite sums step as torch does. (GradScaler itself
    checks only an fp16 sparse grad coalesced: on this bfloat16 or float32 one it would step to
    inf.)"""
    weight = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    param, twin = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    opt = scaledoptim.SGD([param], lr=0.1).configure_scaling(init_scale=1.0, growth_interval=100)
    ref_opt = torch.optim.SGD([twin], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=100)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        scaledoptim.scale_outputs(_embedding_loss(param, step, sparse=True), opt.scale).backward()
        scaler.scale(_embedding_loss(twin, step, sparse=False)).backward()
        assert param.grad.is_sparse and not param.grad.is_coalesced()
        assert param.grad._values().isfinite().all()
        before = param.detach().clone()
        if form == "split":
            found_inf, S = opt.unscale(grads_scaled_by=opt.scale)
            opt.step_after_unscale()
        else:
            _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        scaler.step(ref_opt)
        scaler.update()
        assert found_inf.item() == float(step == 1)
        assert S.item() == scaler.get_scale()
        if step == 1:
            assert torch.equal(param.detach(), before)
        torch.testing.assert_close(param.detach(), twin.detach())
    assert scaler.get_scale() == 0.5  # backed off once
