"""What a CUDA graph capture cannot hold is refused with the fix, before anything changes (the
capture itself runs in tests/gpu; here ``capturing()`` is simulated)."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.torch_ops import capture
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _backward(model, opt):
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, 0), opt.scale).backward()


def test_a_first_step_inside_capture_is_refused_and_a_warm_one_runs(monkeypatch) -> None:
    model = make_model()
    opt = scaledoptim.AdamW(model.parameters())
    _backward(model, opt)
    before = snapshot(opt)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(
        RuntimeError, match=r"inside CUDA graph capture\. Take one eager step first"
    ):
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert_bit_identical(before, snapshot(opt))
    monkeypatch.setattr(capture, "capturing", lambda: False)
    opt.unscale_and_step(grads_scaled_by=opt.scale)  # the eager warm-up step
    _backward(model, opt)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    opt.unscale_and_step(grads_scaled_by=opt.scale)  # state exists: nothing to create
    with pytest.raises(RuntimeError, match=r"pass opt\.scale"):
        opt.unscale_and_step(grads_scaled_by=torch.tensor(1024.0))


def test_the_loss_scale_is_not_created_inside_capture(monkeypatch) -> None:
    opt = scaledoptim.SGD(make_model().parameters(), lr=0.1)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="Creating the loss scale"):
        _ = opt.scale
