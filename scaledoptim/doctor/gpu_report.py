"""``python -m scaledoptim.doctor.gpu_report [REPORT.md]``: the GPU tests, the CUDA benchmarks and
the doctor in one run, written to one Markdown report.

Run it from a checkout (the tests and benchmarks are not in the wheel) with the ``test`` and
``cuda12`` extras installed; installed from a wheel, or without the ``test`` extra, it says so
and exits with status 2. On a
machine without a CUDA device the GPU tests and benchmarks report *skipped* (the tests' CPU twins,
on the emulator, still run) and the doctor skips its GPU checks; the report says so. The summary
at the top repeats the doctor's bandwidth and step-time lines (ours against GradScaler + torch's
fused AdamW, without and with clipping; the bandwidth of the step with clipping in it too), and
its 8-bit states' parity and bandwidth lines (AdamW with ``state_bits=8``, bytes per param
stated).
Exits with status 1 when any part failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import pathlib
import subprocess
import sys
from collections.abc import Sequence

import torch

__all__ = ["PARTS", "Part", "main"]

_PYTEST = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA")


@dataclasses.dataclass(frozen=True)
class Part:
    """One command of the report.

    Args:
        title: the report's heading for it.
        argv: the command.
        needs: paths it needs in the checkout.
        highlights: the first words of output lines that the report's summary repeats.
        modules: the modules it imports from the ``test`` extra (pytest and its plugins).
    """

    title: str
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ()
    highlights: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()


PARTS: tuple[Part, ...] = (
    Part("GPU tests", (*_PYTEST, "tests/gpu"), ("tests/gpu",), modules=("pytest", "hypothesis")),
    Part(
        "CUDA benchmarks",
        (*_PYTEST, "benchmarks/test_bench_cuda_kernels.py"),
        ("benchmarks/test_bench_cuda_kernels.py",),
        modules=("pytest", "pytest_benchmark"),
    ),
    Part(
        "doctor",
        (sys.executable, "-m", "scaledoptim.doctor"),
        highlights=(
            "bandwidth", "clip-bandwidth", "step-time", "clip-step-time", "lowbit-bandwidth",
            "parity:AdamW-8bit",
        ),
    ),
)
_TAIL_LINES = 120  # of each part's output, in the report
# Where the package was imported from: a checkout's root holds tests/, an installed wheel's
# site-packages does not.
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(part: Part, root: pathlib.Path) -> tuple[int, str, float]:
    started = datetime.datetime.now()
    missing = [path for path in part.needs if not (root / path).exists()]
    if missing:
        return 1, f"{missing} not found under {root}: run this from a checkout of scaledoptim", 0.0
    print(f"== {part.title}: {' '.join(part.argv[1:])}", flush=True)
    lines = []
    with subprocess.Popen(
        part.argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:  # streamed: the benchmarks take minutes on a GPU
            print(line, end="", flush=True)
            lines.append(line)
    seconds = (datetime.datetime.now() - started).total_seconds()
    return process.returncode, "".join(lines), seconds


def _section(part: Part, returncode: int, output: str, seconds: float) -> str:
    lines = output.rstrip().splitlines()
    shown = lines[-_TAIL_LINES:]
    cut = f"(last {_TAIL_LINES} of {len(lines)} lines)\n\n" if len(lines) > len(shown) else ""
    verdict = "passed" if returncode == 0 else f"FAILED (exit status {returncode})"
    return (
        f"## {part.title}: {verdict}\n\n`{' '.join(part.argv[1:])}`, {seconds:.0f} s\n\n"
        f"{cut}```text\n" + "\n".join(shown) + "\n```\n"
    )


def _highlighted(part: Part, output: str) -> list[str]:
    """The lines of ``output`` whose first word is one of ``part.highlights``."""
    return [line for line in output.splitlines() if line.split(" ", 1)[0] in part.highlights]


def main(argv: Sequence[str] | None = None, parts: Sequence[Part] = PARTS) -> int:
    """Runs ``parts`` from the current directory and writes the report; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m scaledoptim.doctor.gpu_report")
    parser.add_argument("report", nargs="?", default="gpu-report.md", type=pathlib.Path)
    args = parser.parse_args(argv)
    root = pathlib.Path.cwd()
    missing = [path for part in parts for path in part.needs if not (root / path).exists()]
    if missing and not (_PACKAGE_ROOT / "tests").is_dir():
        parser.exit(
            2,
            f"{parser.prog} needs a checkout of scaledoptim: it runs the GPU tests and "
            f"benchmarks, which the wheel does not ship ({', '.join(missing)} not found under "
            f"{root}). Run it from the root of a clone, after pip install -e \".[test,cuda12]\" "
            "there; from a wheel, python -m scaledoptim.doctor runs the doctor alone.\n",
        )
    modules = {module for part in parts for module in part.modules}
    absent = sorted(module for module in modules if importlib.util.find_spec(module) is None)
    if absent:
        parser.exit(
            2,
            f"{parser.prog} runs the GPU tests and benchmarks with pytest, and {', '.join(absent)} "
            "is not installed: install the test extra, pip install -e \".[test,cuda12]\" in this "
            "checkout (\"[test,cuda13]\" for a CUDA 13 driver).\n",
        )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    sections, failed, highlights = [], [], []
    for part in parts:
        returncode, output, seconds = _run(part, root)
        sections.append(_section(part, returncode, output, seconds))
        highlights += _highlighted(part, output)
        if returncode != 0:
            failed.append(part.title)
    summary = f"FAILED: {', '.join(failed)}" if failed else "every part passed"
    device = gpu or "no CUDA device: the GPU tests and benchmarks report skipped"
    header = (
        f"# scaledoptim GPU report\n\n{datetime.datetime.now():%Y-%m-%d %H:%M}, {device}, "
        f"torch {torch.__version__}.\n\n**{summary}.**\n\n"
    )
    if highlights:
        header += "```text\n" + "\n".join(highlights) + "\n```\n\n"
    args.report.write_text(header + "\n".join(sections))
    print(f"{summary}; report written to {args.report}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
