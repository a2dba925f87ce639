"""Mixed-precision training with the loss scale inside the optimizer, on real models.

``python -m scaledoptim.examples.demo --compare --plot compare.png`` trains a character-level
transformer on the Python standard library's own source and a small CNN on synthetic images,
each with fp32 torch.optim.AdamW, with torch.autocast + torch.amp.GradScaler + AdamW, and with
scaledoptim.autocast + scaledoptim.AdamW, from the same seed, and prints a table per model.
Runs on the GPU when there is one and on the CPU otherwise (fp16 autocast on both by default,
so the loss scale actually matters; ``--dtype bfloat16`` trains without scaling).
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from .compare import format_table, run_variants
from .tasks import SIZES, TASKS
from .train import RunConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=[*TASKS, "all"], default="all")
    parser.add_argument("--compare", action="store_true",
                        help="also train fp32 and torch.amp baselines from the same seed")
    parser.add_argument("--lbfgs", action="store_true",
                        help="also train with scaledoptim.LBFGS and closure replay")
    parser.add_argument("--steps", type=int, help="steps per run (default: per task and size)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=SIZES, help="default: 'cuda' on a GPU, else 'cpu'")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=pathlib.Path, help="write loss and scale curves to a PNG")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = ["fp32", "torch.amp", "scaledoptim"] if args.compare else ["scaledoptim"]
    if args.lbfgs:
        variants.append("scaledoptim-lbfgs")
    config = RunConfig(
        size=args.size or ("cuda" if args.device.startswith("cuda") else "cpu"),
        steps=args.steps, seed=args.seed, device=args.device, dtype=args.dtype,
        progress=not args.no_progress,
    )  # fmt: skip
    results_by_task = {}
    for task in TASKS if args.task == "all" else [args.task]:
        results_by_task[task] = run_variants(
            RunConfig(**{**vars(config), "task": task}), variants
        )
        print(format_table(results_by_task[task]), end="\n\n", flush=True)
    if args.plot:
        from .plot import write_plot  # matplotlib is optional: import it only when asked

        write_plot(results_by_task, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
