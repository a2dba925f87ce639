"""The unscale of the torch forms and of the split form (scaledoptim/torch_ops/skip.py), where the
protocol tests do not reach: an uncoalesced 16-bit sparse grad is checked as its rows sum."""

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


def test_an_uncoalesced_bf16_sparse_grad_is_checked_as_its_rows_sum() -> None:
    """``unscale()`` + ``step_after_unscale()`` on an embedding's bf16 sparse grad against
    ``torch.optim.SGD`` + ``GradScaler`` on the dense embedding, whose grad holds the sums: where
    two finite values of one row sum to inf, the step is skipped and the scale backs off, as on
    the dense grad; finite sums step as torch does."""
    weight = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(0)).bfloat16()
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
        found_inf, S = opt.unscale(grads_scaled_by=opt.scale)
        opt.step_after_unscale()
        scaler.step(ref_opt)
        scaler.update()
        assert found_inf.item() == float(step == 1)
        assert S.item() == scaler.get_scale()
        if step == 1:
            assert torch.equal(param.detach(), before)
        torch.testing.assert_close(param.detach(), twin.detach())
    assert scaler.get_scale() == 0.5  # backed off once
