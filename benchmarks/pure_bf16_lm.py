"""The example language model trained with pure bf16 params (no autocast, no fp32 copy in the
model) under each param rounding option, against fp32 params; prints the held-out losses.

    PYTHONPATH=. python benchmarks/pure_bf16_lm.py [--steps 300] [--lr 2e-3 3e-4] \
        [--optimizer adamw]

Built from ``scaledoptim.examples`` (the model, the data and the held-out loss of its "lm" task).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from scaledoptim.examples.tasks import SIZES, language_model
from scaledoptim.testing.optim_db import rows

VARIANTS = {
    "fp32 params": (torch.float32, {}),
    "bf16, round to nearest": (torch.bfloat16, {}),
    "bf16, master_weights": (torch.bfloat16, dict(master_weights=True)),
    "bf16, stochastic_rounding": (torch.bfloat16, dict(stochastic_rounding=True)),
}
#: Every fused row of optim_db that takes the rounding options, by its lower-case name.
OPTIMIZERS = {info.name.lower(): info.cls for info in rows(fused=True, rounding=True)}


def run(
    optimizer: str, dtype: torch.dtype, rounding: dict, steps: int, lr: float, seed: int = 0
) -> float:
    task = language_model(SIZES["cpu"], torch.device("cpu"))
    torch.manual_seed(seed)
    model = task.make_model().to(dtype)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=lr, **rounding)
    for batch in itertools.islice(task.batches(seed), steps):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    return task.eval_loss(model, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, nargs="+", default=[2e-3, 3e-4])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    args = parser.parse_args()
    print("| variant | " + " | ".join(f"{args.optimizer} lr {lr:g}" for lr in args.lr) + " |")
    print("|---|" + "---|" * len(args.lr))
    for name, (dtype, rounding) in VARIANTS.items():
        losses = [run(args.optimizer, dtype, rounding, args.steps, lr) for lr in args.lr]
        print(f"| {name} | " + " | ".join(f"{loss:.4f}" for loss in losses) + " |", flush=True)


if __name__ == "__main__":
    main()
