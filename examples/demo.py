"""Train a small MLP in fp16 with the loss scale living inside the optimizer.

The main job of the README: ``python examples/demo.py``. Runs on the GPU when there is one and on
the CPU otherwise. The scale starts too high on purpose (2**24), so the first steps overflow in
fp16 and are skipped on device while the scale backs off; later it grows again every
``--growth-interval`` clean steps. Nothing in the loop waits on the host except the printing.
"""

from __future__ import annotations

import argparse
import math

import torch

import scaledoptim


def make_data(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 2, generator=gen) * 2 - 1
    y = torch.sin(math.pi * x[:, :1]) * torch.cos(math.pi * x[:, 1:])  # a smooth 2-D surface
    return x.to(device), y.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--growth-interval", type=int, default=100)
    parser.add_argument("--print-every", type=int, default=50)
    args = parser.parse_args()

    torch.manual_seed(0)
    x, y = make_data(4096, args.device)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 1),
    ).to(args.device)  # fmt: skip
    opt = scaledoptim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    opt.configure_scaling(init_scale=2.0**24, growth_interval=args.growth_interval)
    S = opt.scale
    skipped = torch.zeros((), device=args.device)  # counted on device: no sync per step

    print(f"training a {sum(p.numel() for p in model.parameters())}-parameter MLP in fp16 "
          f"autocast on {args.device}")  # fmt: skip
    print(f"{'step':>6} {'loss':>10} {'scale':>10} {'skipped':>8}")
    for step in range(args.steps + 1):
        idx = torch.randint(0, x.shape[0], (256,), device=args.device)
        with scaledoptim.autocast(args.device, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[idx]).float(), y[idx])
        opt.zero_grad(set_to_none=True)
        scaledoptim.scale_outputs(loss, S).backward()
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
        skipped += found_inf
        if step % args.print_every == 0:
            print(f"{step:>6} {loss.item():>10.5f} {S.item():>10.0f} {int(skipped.item()):>8}")
    with torch.no_grad(), scaledoptim.autocast(args.device, dtype=torch.float16):
        final = torch.nn.functional.mse_loss(model(x).float(), y).item()
    print(f"final full-data loss {final:.5f} (target variance {y.var().item():.5f}); "
          f"{int(skipped.item())} of {args.steps + 1} steps skipped, final scale {S.item():.0f}")


if __name__ == "__main__":
    main()
