"""One row per (optimizer, options): the generic tests run over every row (torch's OptimizerInfo idea)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import scaledoptim


@dataclasses.dataclass(frozen=True)
class OptimizerCase:
    name: str
    ours: type[torch.optim.Optimizer]
    reference: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def __str__(self) -> str:
        return self.name


CASES = [
    OptimizerCase("adamw", scaledoptim.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    OptimizerCase("adamw-amsgrad-maximize", scaledoptim.AdamW, torch.optim.AdamW,
                  dict(lr=1e-2, amsgrad=True, maximize=True)),
    OptimizerCase("adam", scaledoptim.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    OptimizerCase("adam-amsgrad", scaledoptim.Adam, torch.optim.Adam,
                  dict(lr=1e-2, amsgrad=True, betas=(0.8, 0.99))),
    OptimizerCase("sgd", scaledoptim.SGD, torch.optim.SGD, dict(lr=0.05)),
    OptimizerCase("sgd-momentum-wd", scaledoptim.SGD, torch.optim.SGD,
                  dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    OptimizerCase("sgd-nesterov", scaledoptim.SGD, torch.optim.SGD,
                  dict(lr=0.05, momentum=0.9, nesterov=True)),
    OptimizerCase("sgd-dampening-maximize", scaledoptim.SGD, torch.optim.SGD,
                  dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, maximize=True)),
    OptimizerCase("adagrad", scaledoptim.Adagrad, torch.optim.Adagrad, dict(lr=0.1)),
    OptimizerCase("adagrad-every-option", scaledoptim.Adagrad, torch.optim.Adagrad,
                  dict(lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.2,
                       eps=1e-3, maximize=True)),
]  # fmt: skip


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=gen).to(dtype), torch.randn(16, 3, generator=gen).to(dtype)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def ready_with_pending_backward(case: OptimizerCase, growth_interval: int = 5):
    """A model and optimizer (hysteresis 2) two steps in, with a scaled backward pending."""
    model = make_model()
    opt = case.ours(model.parameters(), **case.kwargs).configure_scaling(
        hysteresis=2, growth_interval=growth_interval
    )
    for step in range(3):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if step < 2:
            opt.unscale_and_step(grads_scaled_by=opt.scale)
    return model, opt


def snapshot(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer owns or updates: params, per-param state, the loss scale.

    Meta tensors (which stand in for a second device) hold no values and are left out.
    """
    tensors = [p.detach().clone() for g in opt.param_groups for p in g["params"] if not p.is_meta]
    for state in opt.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    if isinstance(opt, scaledoptim.Optimizer):
        scale_state = opt._scaling().loss_scale
        tensors += [scale_state.scale.clone(), scale_state.growth_tracker.clone(),
                    scale_state.hysteresis_tracker.clone()]  # fmt: skip
    return tensors


def assert_bit_identical(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(_bits(b), _bits(a))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)
