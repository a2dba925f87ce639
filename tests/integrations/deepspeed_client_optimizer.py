"""scaledoptim.AdamW as a DeepSpeed client optimizer (DeepSpeed's fp16 off), checked by hand.

DeepSpeed is not a dependency, so the suite does not run this: with DeepSpeed installed,
``MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 python
tests/integrations/deepspeed_client_optimizer.py`` steps a small model through
``engine.backward(scale_outputs(loss, opt.scale)); engine.step()`` at ZeRO stages 0, 1 and 2,
one step with an inf loss, against ``torch.optim.AdamW`` on unscaled grads, and prints what it
found (docs/integrations/distributed.md, "DeepSpeed", says what it means). Exit status 1 if a
stage's trajectory leaves torch's.
"""

from __future__ import annotations

import sys

import deepspeed
import torch

import scaledoptim

OVERFLOW_AT = 2


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def run(stage: int) -> bool:
    torch.manual_seed(0)
    model, reference = _net(), _net()
    reference.load_state_dict(model.state_dict())
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": False},
        "gradient_clipping": 0.0,  # DeepSpeed's clip would see the scaled grads
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        scale_before = opt.scale.item()
        blowup = float("inf") if step == OVERFLOW_AT else 1.0
        loss = torch.nn.functional.mse_loss(engine(x * blowup), y)
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(scaledoptim.scale_outputs(loss, opt.scale))
        engine.step()
        moved = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        if step != OVERFLOW_AT:
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
        else:
            print(
                f"stage {stage}: the inf step moved params: {moved}; scale "
                f"{scale_before:g} -> {opt.scale.item():g}"
            )
        diff = max(
            (p - q).abs().max().item()
            for p, q in zip(engine.module.parameters(), reference.parameters())
        )
        worst = max(worst, diff)
    print(f"stage {stage}: largest difference from torch.optim.AdamW over 5 steps: {worst:.2e}")
    return worst < 1e-6


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    sys.exit(0 if all([run(stage) for stage in (0, 1, 2)]) else 1)
