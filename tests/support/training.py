"""A small model, its batches and loss, and bit-level snapshots of an optimizer: what the
optimizer-level tests share."""

from __future__ import annotations

import torch

import scaledoptim
from scaledoptim.testing.optim_db import Config, OptimInfo

__all__ = [
    "assert_bit_identical",
    "batch",
    "loss_of",
    "make_model",
    "ready_with_pending_backward",
    "scaled_closure",
    "snapshot",
]


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Sequential:
    """Linear(6, 17), Tanh, Linear(17, 3): two weights and two biases, the same for a seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)).to(
        dtype
    )


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of ``step`` (the same for every run)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=gen).to(dtype), torch.randn(16, 3, generator=gen).to(dtype)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The fp32 mean squared error of ``model`` on ``batch(step)``."""
    dtype = next(model.parameters()).dtype
    x, y = batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def ready_with_pending_backward(
    info: OptimInfo, config: Config | None = None, growth_interval: int = 5
) -> tuple[torch.nn.Sequential, scaledoptim.Optimizer]:
    """A model and the row's optimizer (``config``, or the default; hysteresis 2) two steps in,
    with a scaled backward pending."""
    model = make_model()
    opt = info.make(model.parameters(), config)
    assert isinstance(opt, scaledoptim.Optimizer)
    opt.configure_scaling(hysteresis=2, growth_interval=growth_interval)
    for step in range(3):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if step < 2:
            opt.unscale_and_step(grads_scaled_by=opt.scale)
    return model, opt


def scaled_closure(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    overflow: bool = False,
    touch_params: bool = False,
):
    """A closure ``closure(S)`` of the protocol: zero_grad, then the loss of ``batch(7)`` scaled
    by ``S`` backward; ``overflow`` puts a nan in a grad, ``touch_params`` moves a weight."""

    def closure(S):
        opt.zero_grad()
        loss = loss_of(model, 7)
        scaledoptim.scale_outputs(loss, S).backward()
        if overflow:
            model[0].bias.grad[0] = float("nan")
        if touch_params:
            with torch.no_grad():
                model[0].weight.add_(1.0)
        return loss

    return closure


def snapshot(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer owns or updates: params, per-param state, the loss scale (its
    last three tensors: scale, growth and hysteresis trackers).

    Meta tensors (which stand in for a second device) hold no values and are left out.
    """
    tensors = [p.detach().clone() for g in opt.param_groups for p in g["params"] if not p.is_meta]
    for state in opt.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    if isinstance(opt, scaledoptim.Optimizer):
        scale_state = opt.scaling_state.loss_scale
        tensors += [scale_state.scale.clone(), scale_state.growth_tracker.clone(),
                    scale_state.hysteresis_tracker.clone()]
    return tensors


def assert_bit_identical(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    """Same count, dtypes, shapes and bytes."""
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(_bits(b), _bits(a))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)
