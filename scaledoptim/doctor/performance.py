"""Fused AdamW on the GPU: bytes moved per second as a fraction of a device-to-device copy, and
the step of a loss-scaled loop (:mod:`.adamw_loops`) against ``torch.amp.GradScaler`` +
``torch.optim.AdamW(fused=True)``, without and with gradient clipping (ours clips in the step:
the same bytes per param as without clipping).

Timed with CUDA events over back-to-back steps (the host runs ahead, so its cost is hidden at this
size); on a CPU (the doctor runs these on a GPU only; tests run them on a CPU) with the host clock.
The checks fail only past a sanity bound; the detail states the design target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..fused.backends import select
from .adamw_loops import AdamWLoop, gradscaler_loop, scaledoptim_loop
from .outcome import Outcome

__all__ = ["bandwidth", "clip_bandwidth", "clip_step_time", "seconds_per_call", "step_time"]

N_PARAMS = 1 << 25  # one 32M-element fp32 tensor: 128 MB each of param, grad, m, v
# Inf check reads g (4); update reads p, g, m, v (16), writes p, m, v (12). With clipping in the
# step the same: the check sums the squares as it reads, the update gets inv_scale * coef.
BYTES_PER_PARAM = 32
BANDWIDTH_FLOOR, BANDWIDTH_TARGET = 0.5, 0.9  # of copy bandwidth
STEP_TIME_CEILING = 1.25  # ours / torch's; the design target is <= 1.0


def seconds_per_call(
    fn: Callable[[], object], device: torch.device, repeats: int = 20, rounds: int = 5
) -> float:
    """Median over ``rounds`` of the mean time of ``repeats`` back-to-back calls of ``fn`` on
    ``device`` (CUDA events on a GPU, the host clock elsewhere)."""
    fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            seconds = time.perf_counter() - started
        times.append(seconds / repeats)
    return statistics.median(times)


def _copy_bytes_per_second(device: torch.device, n_bytes: int) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / seconds_per_call(lambda: dst.copy_(src), device)


def _bandwidth(device: torch.device, n_params: int, clip: bool) -> Outcome:
    seconds = _loop_seconds(scaledoptim_loop([n_params], device, clip), device, clip)
    copy = _copy_bytes_per_second(device, BYTES_PER_PARAM * n_params)  # 1 GiB at N_PARAMS
    if device.type == "cuda":
        torch.cuda.empty_cache()
    achieved = BYTES_PER_PARAM * n_params / seconds
    fraction = achieved / copy
    step = "unscale_and_step(max_grad_norm=1.0)" if clip else "unscale_and_step"
    return Outcome(
        BANDWIDTH_FLOOR <= fraction,
        f"{achieved / 1e9:.0f} GB/s at {BYTES_PER_PARAM} B/param = {fraction:.2f} of copy "
        f"({copy / 1e9:.0f} GB/s), {step}, {select(device).name} backend; target >= "
        f"{BANDWIDTH_TARGET}, fails below {BANDWIDTH_FLOOR}",
    )


def bandwidth(device: torch.device, n_params: int = N_PARAMS) -> Outcome:
    """Fails below :data:`BANDWIDTH_FLOOR` of copy bandwidth."""
    return _bandwidth(device, n_params, clip=False)


def clip_bandwidth(device: torch.device, n_params: int = N_PARAMS) -> Outcome:
    """:func:`bandwidth` of the step that clips the global grad norm in the step, on the same
    :data:`BYTES_PER_PARAM` (the grad restore each step needs timed alone and taken off)."""
    return _bandwidth(device, n_params, clip=True)


def _loop_seconds(loop: AdamWLoop, device: torch.device, clip: bool) -> float:
    """Seconds per step of ``loop``; a clipping loop's grad restore timed alone and taken off."""
    seconds = seconds_per_call(loop.step, device)
    return seconds - seconds_per_call(loop.restore, device) if clip else seconds


def _compare_loops(device: torch.device, n_params: int, clip: bool) -> Outcome:
    ours = _loop_seconds(scaledoptim_loop([n_params], device, clip), device, clip)
    theirs = _loop_seconds(gradscaler_loop([n_params], device, clip), device, clip)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ratio = ours / theirs
    loop = (
        "unscale_and_step(max_grad_norm=1.0) vs GradScaler's unscale_ + "
        "clip_grad_norm_ + step + update"
        if clip
        else "unscale_and_step vs GradScaler's step + update"
    )
    return Outcome(
        ratio <= STEP_TIME_CEILING,
        f"{ours * 1e3:.3f} ms vs {theirs * 1e3:.3f} ms ({ratio:.2f}x), {loop}, torch fused AdamW, "
        f"{n_params} fp32 params; target <= 1.0x, fails above {STEP_TIME_CEILING}x",
    )


def step_time(device: torch.device, n_params: int = N_PARAMS) -> Outcome:
    """Our ``unscale_and_step`` against GradScaler + torch's fused AdamW (``step`` + ``update``);
    fails when ours takes more than :data:`STEP_TIME_CEILING` times theirs."""
    return _compare_loops(device, n_params, clip=False)


def clip_step_time(device: torch.device, n_params: int = N_PARAMS) -> Outcome:
    """The clipping loop: ``unscale_and_step(..., max_grad_norm=1.0)`` against
    GradScaler's ``unscale_`` + ``clip_grad_norm_`` + ``step`` + ``update`` (the grad restore
    each step needs timed alone and taken off both); fails as :func:`step_time` does."""
    return _compare_loops(device, n_params, clip=True)
