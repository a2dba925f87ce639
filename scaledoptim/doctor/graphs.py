"""The no-closure ``unscale_and_step`` captured in a CUDA graph replays as an eager step does.

Two optimizers start from the same params: one steps by replaying a graph that captured
``opt.unscale_and_step(grads_scaled_by=opt.scale)``, its twin steps eagerly. Each round copies new
grads (scaled by the current ``opt.scale``, on device) into the same grad tensors, and after each
replay params, state and the scale must equal the twin's bit for bit. Then an inf grad must make
the replay a skip: params and state unchanged, the scale backed off.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import cast

import torch

from ..fused import FusedOptimizer
from .optimizers import OPTIMIZERS, ours
from .outcome import Outcome, same_bits, snapshot

__all__ = ["GraphReplay", "replay_against_eager", "run"]

WARMUP_STEPS = 3  # torch's advice: warm up on a side stream (state, kernels, tables) first


@dataclasses.dataclass
class GraphReplay:
    """What :func:`replay_against_eager` saw: clean replays that matched the eager twin, and the
    scale before and after the replay with an inf grad, and that replay's ``found_inf``."""

    replays_matched: int
    scale_before_inf: float
    scale_after_inf: float
    found_inf_after_inf: float


class ReplayMismatch(AssertionError):
    """A replayed step differs from the eager one (or an inf did not skip)."""


def replay_against_eager(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    params: Sequence[torch.Tensor],
    replays: int = 3,
) -> GraphReplay:
    """Captures ``unscale_and_step`` of ``make_optimizer(copy of params)`` and checks its replays
    against an eager twin (see the module docs); params live on one CUDA device.

    Raises:
        ReplayMismatch: naming the first tensor that differs.
    """
    device = params[0].device
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = cast(FusedOptimizer, make_optimizer(ours_params))  # the doctor's rows are fused
    twin = cast(FusedOptimizer, make_optimizer(twin_params))
    generator = torch.Generator(device=device).manual_seed(0)

    def new_grads() -> list[torch.Tensor]:
        return [torch.randn(p.shape, device=device, generator=generator) for p in params]

    def set_grads(opt, opt_params, grads) -> None:
        for p, g in zip(opt_params, grads):  # into the same grad tensors, after the first
            scaled = (g * opt.scale).to(p.dtype)
            if p.grad is None:
                p.grad = scaled
            else:
                p.grad.copy_(scaled)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            grads = new_grads()
            for opt, opt_params in ((ours, ours_params), (twin, twin_params)):
                set_grads(opt, opt_params, grads)
                opt.unscale_and_step(grads_scaled_by=opt.scale)
    torch.cuda.current_stream(device).wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # found_inf is allocated inside the capture: every replay rewrites this tensor.
        _, found_inf, _ = ours.unscale_and_step(grads_scaled_by=ours.scale)

    for replay in range(replays):
        grads = new_grads()
        set_grads(ours, ours_params, grads)
        graph.replay()
        set_grads(twin, twin_params, grads)
        _, twin_found_inf, _ = twin.unscale_and_step(grads_scaled_by=twin.scale)
        torch.cuda.synchronize(device)
        difference = same_bits(snapshot(ours), snapshot(twin))
        if difference is None and not torch.equal(found_inf, twin_found_inf):
            difference = f"found_inf {found_inf.item()} vs {twin_found_inf.item()}"
        if difference is not None:
            raise ReplayMismatch(f"replay {replay + 1} differs from the eager step: {difference}")

    grads = new_grads()
    grads[-1].view(-1)[0] = float("inf")
    set_grads(ours, ours_params, grads)
    torch.cuda.synchronize(device)
    before, scale_before = snapshot(ours, scale=False), ours.scale.item()
    graph.replay()
    torch.cuda.synchronize(device)
    after = snapshot(ours, scale=False)
    scale_after = ours.scale.item()
    difference = same_bits(before, after)
    if difference is not None:
        raise ReplayMismatch(f"a replay with an inf grad changed {difference}")
    return GraphReplay(replays, scale_before, scale_after, found_inf.item())


def run(device: torch.device) -> Outcome:
    """Every optimizer of :data:`OPTIMIZERS`, fp32 and bf16 params, three replays and a skip."""
    params = [
        torch.randn(n, device=device, dtype=dtype)
        for n, dtype in ((1, torch.float32), (4099, torch.float32), (33, torch.bfloat16))
    ]
    for row in OPTIMIZERS:
        try:
            seen = replay_against_eager(functools.partial(ours, row), params)
        except ReplayMismatch as error:
            return Outcome(False, f"{row.name}: {error}")
        if seen.found_inf_after_inf != 1.0 or seen.scale_after_inf != seen.scale_before_inf / 2:
            return Outcome(
                False,
                f"{row.name}: the replay with an inf grad gave found_inf="
                f"{seen.found_inf_after_inf}, scale {seen.scale_before_inf} -> "
                f"{seen.scale_after_inf}",
            )
    names = ", ".join(row.name for row in OPTIMIZERS)
    return Outcome(True, f"{names}: 3 replays bit-identical to eager steps, an inf replay skipped")
