"""Mixed-precision training with the loss scale inside the optimizer, on real models.

``python -m scaledoptim.examples.demo --compare --plot compare.png`` trains a character-level
transformer on the Python standard library's own source and a small CNN on synthetic images,
each with fp32 torch.optim.AdamW, with torch.autocast + torch.amp.GradScaler + AdamW, and with
scaledoptim.autocast + scaledoptim.AdamW, from the same seed, a step of each in turn, and prints
a table per model: held-out loss, step times, host reads per step, skipped steps, final scale.
``--lbfgs`` adds a full-batch LBFGS run, fp32 against scaledoptim's fp16 with closure replay.
``--model hf-gpt2`` trains a Hugging Face GPT-2 (the ``examples-hf`` extra) the same way.
Runs on the GPU when there is one (full-size models) and on the CPU otherwise (small models,
short runs, on one intra-op thread: see ``--threads``); fp16 autocast on both by default, so
the loss scale actually matters (``--dtype bfloat16`` trains without scaling).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import torch

from .compare import format_table, gradscaler_refusal, run_interleaved
from .deps import install_hint, problems
from .tasks import SIZES, TASKS
from .train import RunConfig

DEFAULT_TASKS = ("lm", "cnn")  # "all": the built-in models; hf-gpt2 needs an extra


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scaledoptim.examples.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model",
        "--task",
        dest="task",
        choices=[*TASKS, "all"],
        default="all",
        help="'all': lm and cnn; hf-gpt2 needs the examples-hf extra: "
        + install_hint("examples-hf"),
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also train fp32 and torch.amp baselines from the same seed",
    )
    parser.add_argument(
        "--lbfgs",
        action="store_true",
        help="also train a full-batch model with fp32 LBFGS and scaledoptim.LBFGS",
    )
    parser.add_argument("--steps", type=int, help="steps per run (default: per task and size)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=SIZES, help="default: 'cuda' on a GPU, else 'cpu'")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads for CPU training (default 1: the small CPU "
        "models run fastest on one, busy machine or not; 0: torch's setting)",
    )
    parser.add_argument("--plot", type=pathlib.Path, help="write loss and scale curves to a PNG")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    found = problems(args)  # before any training: missing extras and unusable devices
    if found:
        raise SystemExit("\n".join(f"error: {problem}" for problem in found))
    progress = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        def progress(total: int, name: str):
            return tqdm(total=total, desc=name)

    config = RunConfig(
        size=args.size or ("cuda" if args.device.startswith("cuda") else "cpu"),
        steps=args.steps, seed=args.seed, device=args.device, dtype=args.dtype,
        threads=args.threads or None,
    )
    variants = ["fp32", "torch.amp", "scaledoptim"] if args.compare else ["scaledoptim"]
    results_by_task = {}
    for task in DEFAULT_TASKS if args.task == "all" else [args.task]:
        results = run_interleaved(dataclasses.replace(config, task=task), variants, progress)
        results_by_task[task] = results
        print(format_table(results), end="\n\n", flush=True)
    if args.lbfgs:
        lbfgs = dataclasses.replace(config, task="lbfgs", growth_interval=10)
        results = run_interleaved(lbfgs, ["fp32-lbfgs", "scaledoptim-lbfgs"], progress)
        results_by_task["lbfgs"] = results
        print(format_table(results), gradscaler_refusal(args.device), sep="\n", end="\n\n")
    if args.plot:
        from .plot import write_plot  # matplotlib is optional: imported only when asked

        write_plot(results_by_task, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
