"""10,000 steps with random overflows: nothing non-finite ever lands, every overflow is a skip.

Kept to a Linear(4, 4) so the soak costs seconds; the per-step checks accumulate on device and
are read once at the end.
"""

from __future__ import annotations

import random

import torch

import scaledoptim

STEPS = 10_000
MIN_SCALE, MAX_SCALE = 2.0**-4, 2.0**20  # far from fp32 overflow: only injected infs overflow


def test_soak_random_overflows_are_exactly_the_skips() -> None:
    """Slow (10,000 steps). Exists for what only a long random sequence meets: a non-finite
    value that lands in params or state, or a skip that is not an overflow, once the scale has
    been backed off to ``min_scale`` and grown to ``max_scale`` many times (the tables run three
    steps)."""
    rng = random.Random(0)
    model = torch.nn.Linear(4, 4)
    params = list(model.parameters())
    opt = scaledoptim.AdamW(params, lr=1e-3, weight_decay=0.01).configure_scaling(
        init_scale=2.0**8,
        growth_interval=20,
        hysteresis=2,
        min_scale=MIN_SCALE,
        max_scale=MAX_SCALE,
    )
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    skipped, backoffs = torch.zeros(()), torch.zeros(())
    non_finite = torch.zeros((), dtype=torch.bool)
    lowest, highest = opt.scale.clone(), opt.scale.clone()
    injected = 0
    S = opt.scale
    for _ in range(STEPS):
        opt.zero_grad()
        scaledoptim.scale_outputs(torch.nn.functional.mse_loss(model(x), y), S).backward()
        if rng.random() < 0.05:
            injected += 1
            grad = rng.choice(params).grad.view(-1)
            grad[rng.randrange(grad.numel())] = rng.choice(
                [float("inf"), -float("inf"), float("nan")]
            )
        before = S.clone()
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
        skipped += found_inf
        backoffs += S < before
        tensors = params + [t for s in opt.state.values() for t in s.values()]
        non_finite |= ~torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        torch.minimum(lowest, S, out=lowest)
        torch.maximum(highest, S, out=highest)
    assert injected > 400
    assert skipped.item() == injected
    assert not non_finite.item()
    assert MIN_SCALE <= lowest.item() and highest.item() <= MAX_SCALE
    assert backoffs.item() > 0 and highest.item() > 2.0**8, "the scale both backed off and grew"
