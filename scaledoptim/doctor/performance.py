"""Fused AdamW on the GPU: bytes moved per second as a fraction of a device-to-device copy, and
step time against ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``.

Timed with CUDA events over back-to-back steps (the host runs ahead, so its cost is hidden at this
size). The checks fail only below a sanity floor; the detail states the design target.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import scaledoptim

from ..fused.backends import select
from .outcome import Outcome

__all__ = ["bandwidth", "step_time"]

N_PARAMS = 1 << 25  # one 32M-element fp32 tensor: 128 MB each of param, grad, m, v
SCALE = 2.0**16
BYTES_PER_PARAM = 32  # inf check reads g (4); update reads p, g, m, v (16), writes p, m, v (12)
BANDWIDTH_FLOOR, BANDWIDTH_TARGET = 0.5, 0.9  # of copy bandwidth
STEP_TIME_CEILING = 1.25  # ours / torch's; the design target is <= 1.0


def _seconds_per_call(fn: Callable[[], object], repeats: int = 20, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean time of ``repeats`` back-to-back calls."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(times)


def _ours(device: torch.device) -> Callable[[], object]:
    param = torch.nn.Parameter(torch.randn(N_PARAMS, device=device))
    param.grad = torch.randn(N_PARAMS, device=device) * SCALE
    opt = scaledoptim.AdamW([param], lr=1e-3, weight_decay=0.01).configure_scaling(
        init_scale=SCALE, growth_interval=10**9
    )
    return lambda: opt.unscale_and_step(grads_scaled_by=opt.scale)


def _torch_gradscaler(device: torch.device) -> Callable[[], object]:
    param = torch.nn.Parameter(torch.randn(N_PARAMS, device=device))
    param.grad = torch.randn(N_PARAMS, device=device) * SCALE
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=10**9)

    def step() -> None:
        scaler.step(opt)  # fused: the unscale is folded into the kernel, no host sync
        scaler.update()

    return step


def _copy_bytes_per_second(device: torch.device, n_bytes: int = 1 << 30) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _seconds_per_call(lambda: dst.copy_(src))


def bandwidth(device: torch.device) -> Outcome:
    """Fails below :data:`BANDWIDTH_FLOOR` of copy bandwidth."""
    seconds = _seconds_per_call(_ours(device))
    copy = _copy_bytes_per_second(device)
    torch.cuda.empty_cache()
    achieved = BYTES_PER_PARAM * N_PARAMS / seconds
    fraction = achieved / copy
    return Outcome(
        BANDWIDTH_FLOOR <= fraction,
        f"{achieved / 1e9:.0f} GB/s at {BYTES_PER_PARAM} B/param = {fraction:.2f} of copy "
        f"({copy / 1e9:.0f} GB/s), {select(device).name} backend; target >= {BANDWIDTH_TARGET}, "
        f"fails below {BANDWIDTH_FLOOR}",
    )


def step_time(device: torch.device) -> Outcome:
    """Fails when our step takes more than :data:`STEP_TIME_CEILING` times torch's."""
    ours = _seconds_per_call(_ours(device))
    theirs = _seconds_per_call(_torch_gradscaler(device))
    torch.cuda.empty_cache()
    ratio = ours / theirs
    return Outcome(
        ratio <= STEP_TIME_CEILING,
        f"{ours * 1e3:.3f} ms vs {theirs * 1e3:.3f} ms for GradScaler + torch fused AdamW "
        f"({ratio:.2f}x) at {N_PARAMS} fp32 params; target <= 1.0x, fails above "
        f"{STEP_TIME_CEILING}x",
    )
