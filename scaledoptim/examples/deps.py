"""Checks, before any training, that everything the chosen options need is installed and usable.

A missing package or an unusable device is reported in one message naming every problem and the
fix, instead of a traceback after minutes of training.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

# module -> (why the examples need it, the pip extra that installs it)
OPTIONAL = {
    "tqdm": ("the progress bars (or pass --no-progress)", "examples"),
    "matplotlib": ("--plot", "plot"),
    "transformers": ("--model hf-gpt2", "examples-hf"),
}


def install_hint(extra: str) -> str:
    """How to install one of scaledoptim's extras. scaledoptim is not on PyPI: from a checkout
    it is installed editable; where it was installed from a wheel, pip adds the extra's packages
    to the installed scaledoptim."""
    return (f'pip install -e ".[{extra}]" in a checkout, or pip install "scaledoptim[{extra}]" '
            "where scaledoptim was installed from a wheel")


def needed_modules(args: argparse.Namespace) -> list[str]:
    """The optional modules that ``args`` will import."""
    needed = [] if args.no_progress else ["tqdm"]
    if args.plot:
        needed.append("matplotlib")
    if args.task == "hf-gpt2":
        needed.append("transformers")
    return needed


def problems(args: argparse.Namespace) -> list[str]:
    """Every missing module and an unusable device, one line each, each with its fix."""
    found = []
    for module in needed_modules(args):
        if importlib.util.find_spec(module) is None:
            why, extra = OPTIONAL[module]
            found.append(f"{module} is not installed; it is needed for {why}: "
                         f"{install_hint(extra)} (or pip install {module})")
    device_problem = unusable_device(args.device)
    if device_problem:
        found.append(device_problem)
    return found


def unusable_device(device: str) -> str | None:
    """Why ``device`` cannot train here, or ``None`` if it can."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        return f"--device {device} is not a device name ({error}); use --device cpu or cuda"
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return (f"--device {device}: this torch sees no CUDA GPU (torch.cuda.is_available() is "
                "False); use --device cpu, or install a CUDA build of torch on a GPU machine")
    try:
        torch.zeros(1, device=parsed)
    except (RuntimeError, AssertionError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        return f"--device {device} cannot be used here ({first_line}); use --device cpu"
    return None
