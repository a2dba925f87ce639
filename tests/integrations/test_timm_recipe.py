"""``scaledoptim.integrations.timm.NativeScaler`` (docs/recipes/timm.md) against timm's stock loss
scaler.

timm does not install next to the torch this project tests with, so the stock scaler is the
stand-in of ``ports/timm/timm_utils.py``: ``timm.utils.NativeScaler``'s call convention around
``torch.amp.GradScaler``, written for these tests from timm's documented behaviour.
"""

from __future__ import annotations

import sys

import pytest
import torch

import scaledoptim
from scaledoptim.integrations.timm import NativeScaler
from tests.integrations.test_ports import PORTS

sys.path.insert(0, str(PORTS / "timm"))
try:
    from timm_utils import NativeScaler as StockNativeScaler
finally:
    sys.path.remove(str(PORTS / "timm"))


def _train(loss_scaler, optimizer_cls, model, steps, accumulate=1, clip_mode="norm"):
    """timm's train_one_epoch, reduced to what it does with ``loss_scaler``."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True)
    optimizer = optimizer_cls(model.parameters(), lr=1e-2)
    losses, scales = [], []
    for step in range(steps):
        need_update = (step + 1) % accumulate == 0
        batch = slice(step % 8 * 32, step % 8 * 32 + 32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[batch]).float(), y[batch]) / accumulate
        loss_scaler(
            loss,
            optimizer,
            clip_grad=1.0,
            clip_mode=clip_mode,
            parameters=model.parameters(),
            need_update=need_update,
        )
        if need_update:
            optimizer.zero_grad()
            scales.append(_scaler(loss_scaler).get_scale())
        losses.append(loss.item())
    return losses, scales, optimizer


def _scaler(loss_scaler) -> torch.amp.GradScaler:
    return loss_scaler.scaler if isinstance(loss_scaler, NativeScaler) else loss_scaler._scaler


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_it_follows_timms_stock_loss_scaler(accumulate):
    stock_model, scaled_model = _model(), _model()
    stock = _train(
        StockNativeScaler("cpu", init_scale=2.0**24), torch.optim.AdamW, stock_model, 40, accumulate
    )
    ours = _train(
        NativeScaler("cpu", init_scale=2.0**24), scaledoptim.AdamW, scaled_model, 40, accumulate
    )

    assert ours[1] == stock[1]  # the same scale after every update: the same skipped steps
    assert min(stock[1]) < 2.0**24  # some steps overflowed and were skipped
    # Within what the clip's rounding, and torch's foreach AdamW against the fused one, add up
    # to over 40 steps (docs/recipes/clipping.md).
    assert ours[0] == pytest.approx(stock[0], rel=1e-3)
    for p, q in zip(scaled_model.parameters(), stock_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    assert ours[2].scale.item() == ours[1][-1]  # the scale lives in the optimizer
    assert ours[2].grad_norm is not None  # the norm clip happened in the step


def test_clipping_by_value_unscales_first_and_clips_the_parameters():
    model, reference = _model(), _model()
    ours = _train(NativeScaler("cpu"), scaledoptim.AdamW, model, 8, clip_mode="value")
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True)
    for step in range(8):
        batch = slice(step % 8 * 32, step % 8 * 32 + 32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(reference(x[batch]).float(), y[batch])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_value_(reference.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert ours[2].grad_norm is None  # not the norm clip of the step
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_timm_clip_mode_without_timm_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # as if timm were not installed
    model = _model()
    opt = scaledoptim.AdamW(model.parameters())
    loss_scaler = NativeScaler("cpu")
    with pytest.raises(ValueError, match="install timm"):
        loss_scaler(model(torch.randn(4, 8)).sum(), opt, clip_grad=0.1, clip_mode="agc",
                    parameters=model.parameters())


def test_checkpoints_cross_to_timms_stock_loss_scaler():
    ours = NativeScaler("cpu", init_scale=2.0**24)
    _, scales, _ = _train(ours, scaledoptim.AdamW, _model(), 20)
    checkpoint = {ours.state_dict_key: ours.state_dict()}

    stock = StockNativeScaler("cpu")
    stock.load_state_dict(checkpoint[StockNativeScaler.state_dict_key])
    assert stock._scaler.get_scale() == scales[-1]
    back = NativeScaler("cpu")
    back.load_state_dict(stock.state_dict())
    assert back.scaler.get_scale() == scales[-1]
