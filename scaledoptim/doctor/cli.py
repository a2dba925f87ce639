"""``python -m scaledoptim.doctor [--json PATH] [--only NAMES] [--all-archs] [--device DEV]``."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

import torch

from . import compile_check, render
from .checks import CHECKS, Check, run_checks
from .environment import environment

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scaledoptim.doctor",
        description="Prints the environment, then checks that scaledoptim's kernels compile, "
        "match torch.optim, never sync with the host, capture in CUDA graphs and run fast. "
        "Exits with status 1 when a check fails.",
    )
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH",
                        help="also write the environment and results as JSON to PATH")
    parser.add_argument(
        "--only", metavar="NAMES", default="",
        help="comma-separated check names to run; a name before ':' selects all of its kind "
        f"(e.g. 'parity'). Checks: {', '.join(c.name for c in CHECKS)}",
    )
    parser.add_argument("--all-archs", action="store_true",
                        help="without a GPU, compile for every target arch the installed NVRTC "
                        "supports, not just its oldest and newest (several minutes)")
    parser.add_argument("--device", default=None,
                        help="device to check (default: cuda if available, else cpu)")
    return parser


def _selected(parser: argparse.ArgumentParser, only: str) -> list[Check]:
    if not only:
        return list(CHECKS)
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    chosen = [c for c in CHECKS if c.name in wanted or c.name.split(":")[0] in wanted]
    known = {c.name for c in CHECKS} | {c.name.split(":")[0] for c in CHECKS}
    unknown = sorted(wanted - known)
    if unknown:
        parser.error(f"unknown check name(s) {unknown} in --only; choose from {sorted(known)}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the doctor; returns the exit status (1 when any check failed)."""
    parser = _parser()
    args = parser.parse_args(argv)
    checks = _selected(parser, args.only)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    compile_check.ALL_ARCHS = args.all_archs
    env = environment(device)
    print("scaledoptim doctor\n")
    print(render.environment_text(env), end="\n\n")
    print(render.table_header(), flush=True)
    results = run_checks(device, checks, report=lambda r: print(render.result_line(r), flush=True))
    print(f"\n{render.summary_line(results)}")
    if args.json is not None:
        args.json.write_text(render.as_json(env, results))
        print(f"JSON written to {args.json}")
    return 1 if any(r.status == "fail" for r in results) else 0
