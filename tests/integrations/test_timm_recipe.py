"""docs/recipes/timm.md: its ``ScaledLossScaler`` against timm's stock loss scaler.

timm does not install next to the torch this project tests with, so ``StockNativeScaler`` below
stands in for ``timm.utils.NativeScaler``: written here from timm's documented call convention
(``loss_scaler(loss, optimizer, clip_grad=, clip_mode=, parameters=, create_graph=,
need_update=)``, ``state_dict_key``, ``state_dict``/``load_state_dict``) around
``torch.amp.GradScaler``, as timm's is.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import torch

import scaledoptim

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "recipes" / "timm.md"


class StockNativeScaler:
    """The stand-in for ``timm.utils.NativeScaler`` (see the module docstring)."""

    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        self.scaler = torch.amp.GradScaler(device, **kwargs)

    def __call__(
        self,
        loss,
        optimizer,
        clip_grad=None,
        clip_mode="norm",
        parameters=None,
        create_graph=False,
        need_update=True,
    ) -> None:
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert clip_mode == "norm" and parameters is not None
                self.scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)


def _page_namespace() -> dict[str, Any]:
    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)[0]
    namespace: dict[str, Any] = {"__name__": "timm_recipe"}
    exec(compile(code, str(PAGE), "exec"), namespace)
    return namespace


def _train(loss_scaler, optimizer_cls, model, steps, accumulate=1, start=0):
    """timm's train_one_epoch, reduced to what it does with ``loss_scaler``."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True)
    optimizer = optimizer_cls(model.parameters(), lr=1e-2)
    losses, scales = [], []
    for step in range(start, start + steps):
        need_update = (step + 1) % accumulate == 0
        batch = slice(step % 8 * 32, step % 8 * 32 + 32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[batch]).float(), y[batch]) / accumulate
        loss_scaler(
            loss,
            optimizer,
            clip_grad=1.0,
            clip_mode="norm",
            parameters=model.parameters(),
            need_update=need_update,
        )
        if need_update:
            optimizer.zero_grad()
            scales.append(loss_scaler.scaler.get_scale())
        losses.append(loss.item())
    return losses, scales, optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_recipe_follows_timms_stock_loss_scaler(accumulate):
    ScaledLossScaler = _page_namespace()["ScaledLossScaler"]
    stock_model, scaled_model = _model(), _model()
    stock = _train(
        StockNativeScaler("cpu", init_scale=2.0**24), torch.optim.AdamW, stock_model, 40, accumulate
    )
    ours = _train(
        ScaledLossScaler("cpu", init_scale=2.0**24), scaledoptim.AdamW, scaled_model, 40, accumulate
    )

    assert ours[1] == stock[1]  # the same scale after every update: the same skipped steps
    assert min(stock[1]) < 2.0**24  # some steps overflowed and were skipped
    assert ours[0] == pytest.approx(stock[0], rel=1e-5)
    for p, q in zip(scaled_model.parameters(), stock_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert ours[2].scale.item() == ours[1][-1]  # the scale lives in the optimizer


def test_checkpoints_cross_to_timms_stock_loss_scaler():
    ScaledLossScaler = _page_namespace()["ScaledLossScaler"]
    ours = ScaledLossScaler("cpu", init_scale=2.0**24)
    _, scales, _ = _train(ours, scaledoptim.AdamW, _model(), 20)
    checkpoint = {ours.state_dict_key: ours.state_dict()}

    stock = StockNativeScaler("cpu")
    stock.load_state_dict(checkpoint[StockNativeScaler.state_dict_key])
    assert stock.scaler.get_scale() == scales[-1]
    back = ScaledLossScaler("cpu")
    back.load_state_dict(stock.state_dict())
    assert back.scaler.get_scale() == scales[-1]
