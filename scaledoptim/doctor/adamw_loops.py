"""The AdamW step of a loss-scaled training loop, written as users write it, with scaledoptim and
with ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``: without clipping, and with
global-norm clipping (ours ``unscale_and_step(..., max_grad_norm=)``, GradScaler's ``unscale_`` +
``clip_grad_norm_`` before the step). The doctor's ``step-time``, ``clip-step-time`` and
``clip-bandwidth`` checks and the CUDA benchmarks time them side by side.

Each loop gets its grads from a backward of a loss scaled as users scale it
(``scaler.scale(loss).backward()``; ``scale_outputs(loss, opt.scale).backward()``), so GradScaler
has the scale its ``step`` needs, and both optimizers see the same scaled grads. A clipping loop
may unscale its grads in place (GradScaler's does; ours does on the torch backend, not on our
kernels), so its ``step`` first puts the scaled grads back: time ``restore`` alone and subtract
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

import scaledoptim

__all__ = ["SCALE", "AdamWLoop", "gradscaler_loop", "scaledoptim_loop"]

SCALE = 2.0**16
LR, WEIGHT_DECAY = 1e-3, 0.01
MAX_GRAD_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class AdamWLoop:
    """One loop's optimizer work per iteration, over params whose scaled grads are set.

    Args:
        step: one iteration: (restore,) unscale, clip, step and scale update as the loop does.
        restore: copies the scaled grads back into ``params``' grads (a clipping loop's ``step``
            calls it first; a loop without clipping never changes its grads).
        params: the params the loop steps.
    """

    step: Callable[[], object]
    restore: Callable[[], object]
    params: list[torch.nn.Parameter]


def _params_and_loss(
    sizes: Sequence[int], device: torch.device, seed: int
) -> tuple[list[torch.nn.Parameter], Callable[[], torch.Tensor]]:
    """Params of ``sizes`` and a loss whose grad w.r.t. each param is a fixed random tensor."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(device)) for n in sizes]
    slopes = [torch.randn(n, generator=generator).to(device) for n in sizes]
    return params, lambda: sum((p * s).sum() for p, s in zip(params, slopes))  # type: ignore[return-value]


def _grad_restorer(params: Sequence[torch.nn.Parameter]) -> Callable[[], object]:
    grads = [p.grad for p in params if p.grad is not None]
    saved = [g.clone() for g in grads]
    return lambda: torch._foreach_copy_(grads, saved)


def scaledoptim_loop(
    sizes: Sequence[int], device: torch.device, clip: bool = False, seed: int = 0
) -> AdamWLoop:
    """``scaledoptim.AdamW``: ``unscale_and_step``, with ``max_grad_norm=MAX_GRAD_NORM`` when
    ``clip`` (the norm from the inf check's read, the clip factor in the update)."""
    params, loss = _params_and_loss(sizes, device, seed)
    opt = scaledoptim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY).configure_scaling(
        init_scale=SCALE, growth_interval=10**9
    )
    scaledoptim.scale_outputs(loss(), opt.scale).backward()
    restore = _grad_restorer(params)

    def step() -> None:
        opt.unscale_and_step(grads_scaled_by=opt.scale)

    def clipped_step() -> None:
        restore()
        opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=MAX_GRAD_NORM)

    return AdamWLoop(clipped_step if clip else step, restore, params)


def gradscaler_loop(
    sizes: Sequence[int], device: torch.device, clip: bool = False, seed: int = 0
) -> AdamWLoop:
    """``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``: ``scaler.step`` +
    ``update`` (the fused kernel unscales, no host sync), after ``scaler.unscale_`` +
    ``clip_grad_norm_`` when ``clip``."""
    params, loss = _params_and_loss(sizes, device, seed)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=10**9)
    scaler.scale(loss()).backward()  # GradScaler.step needs the scale this creates
    restore = _grad_restorer(params)

    def step() -> None:
        scaler.step(opt)
        scaler.update()

    def clipped_step() -> None:
        restore()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        scaler.step(opt)
        scaler.update()

    return AdamWLoop(clipped_step if clip else step, restore, params)
