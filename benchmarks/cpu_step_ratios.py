"""CPU step time and transient memory of scaledoptim against the best alternative, in one run.

Each case (optimizer, shape) builds every option over its own copy of the same params and
scaled grads (2**16), then times one step per option per round, interleaved, with the grads
restored before every step; each round starts one option later than the one before (A B C,
B C A, C A B, ...), so that no option always runs first, or always right after the same other.
A repetition's time of an option is its median over the rounds, and its ratio ours /
alternative (< 1: ours is faster) is ours' time over the alternative's in that repetition.
Transient memory is the peak of the CPU allocations alive during one step, over what was alive
before it (torch's profiler), in bytes per param.

It prints the environment (software, CPU, threads) and the load average at the start and the
end, then the table of docs/performance.md: optimizer x alternative, a column per shape, each
cell the median [min-max] of its values, and transient bytes/param. A cell's values are the
repetitions' ratios in this process or, with ``--processes N``, one per fresh process (each the
median of its own repetitions): the script runs itself N times, one after the other, with
``--one-process``, which prints its times as JSON. A cell whose values disagree by more than
15% (max / min) is printed as the range with the reason: ``bimodal: a / b`` when one gap
between neighbouring values is that large (a, b: the medians either side of it), else
``spread: ...`` with every value.

    python benchmarks/cpu_step_ratios.py [--cases AdamW Adagrad SGD RMSprop Lion LAMB clip SR]
        [--shapes 1x25M 500x10k 2000x1k char-lm]
        [--rounds 15] [--reps 3] [--threads 1] [--processes 3] [--clock wall]

What each option's timed step runs:
    ours: ``opt.unscale_and_step(grads_scaled_by=S)`` (the unscale, the inf check and the
        update, skipping on inf).
    GS + X: ``scaler.step(X)`` then ``scaler.update()`` with a ``torch.amp.GradScaler``; no
        separate ``unscale_`` call. ``scaler.step`` unscales the grads itself: for a foreach
        or for-loop X with ``_amp_foreach_non_finite_check_and_unscale_``, then reads
        ``found_inf`` on the host and calls ``X.step()``; for a fused torch X it hands
        ``grad_scale`` and ``found_inf`` to the fused step, which unscales and skips inside.

The options per case:
    Every optimizer at lr 1e-9. AdamW, Adam and Adagrad (weight decay 0.01), SGD (nesterov,
        momentum 0.9, weight decay 0.01): ours, GS + torch fused, GS + torch foreach. The same
        without weight decay (``-nowd``): ours, GS + torch fused.
    RMSprop (momentum 0.9, weight decay 0.01, not centered): ours, GS + torch foreach (torch
        2.13 has no fused RMSprop).
    Lion / LAMB: ours, GS + the foreach versions of test_bench_new_optimizers.py (the same
        math), and, where the bench extra installed them, GS + lion-pytorch's Lion and
        GS + pytorch-optimizer's Lion and Lamb (foreach). Its Lamb is made as close to ours
        (Apex FusedLAMB's semantics) as it goes: clipping by the global grad norm (pre_norm),
        weight decay 0.01 (decoupled from the trust ratio, unlike ours); it has no bias
        correction, so it does less work.
    LAMB-v3: ours configured as pytorch-optimizer's Lamb defaults (no bias correction, clipping
        or weight decay; trust ratio on) against them: the same math but its cap of ||p|| at 10.
    clip (AdamW, global-norm clipping to 1.0, active on every step): ours
        ``opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=1.0)``; GS + clip + torch fused
        / foreach AdamW: ``scaler.unscale_(opt)``, ``clip_grad_norm_(params, 1.0)``,
        ``scaler.step(opt)``, ``scaler.update()`` (torch's clipping recipe); ours-split:
        ``opt.unscale`` + ``clip_grad_norm_`` + ``opt.step_after_unscale()``; and a row of
        ours-split over GS + clip + torch fused AdamW.
    SR (AdamW on bf16 params): ours with stochastic rounding, ours rounding to nearest,
        GS + torch fused AdamW on fp32 params; and a row of ours rounding to nearest over
        GS + torch fused AdamW on fp32 params.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_new_optimizers import ForeachLAMB, ForeachLion
from transient_memory import peak_transient_bytes

import scaledoptim

SCALE = 2.0**16
#: What a step's time is read from (``--clock``): wall-clock time, or this thread's CPU time,
#: which leaves out the time the step waited for a core on a loaded machine.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCK = [time.perf_counter]
# Values of one cell further apart than this (max / min - 1) are printed as a range with why.
DISAGREEMENT = 0.15


def _char_lm_sizes() -> list[int]:
    """The example LM's parameter sizes at its GPU size (built on "meta": nothing allocated)."""
    from scaledoptim.examples.models import CharTransformer
    from scaledoptim.examples.tasks import SIZES

    size = SIZES["cuda"]
    with torch.device("meta"):
        model = CharTransformer(size.context, size.width, size.depth, heads=4)
    return [p.numel() for p in model.parameters()]


SHAPES: dict[str, Callable[[], list[int]]] = {
    "1x25M": lambda: [25_000_000],
    "500x10k": lambda: [10_000] * 500,
    "2000x1k": lambda: [1_000] * 2000,
    "char-lm": _char_lm_sizes,
}
Step = Callable[[], Any]


def gradscaler(opt: torch.optim.Optimizer, clip: float | None = None) -> Step:
    """``scaler.step(opt)`` + ``update()``; with ``clip``, ``scaler.unscale_(opt)`` and
    ``clip_grad_norm_(params, clip)`` before them (torch's clipping recipe)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    params = [p for group in opt.param_groups for p in group["params"]]

    def step() -> None:
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(opt)
        scaler.update()

    return step


def ours(opt: Any, clip: float | None = None) -> Step:
    """``opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=clip)``."""
    opt.configure_scaling(init_scale=SCALE)
    S = opt.scale
    return lambda: opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=clip)


def ours_split(opt: Any, clip: float) -> Step:
    """``opt.unscale`` + ``clip_grad_norm_`` + ``opt.step_after_unscale()`` (the split form)."""
    opt.configure_scaling(init_scale=SCALE)
    S = opt.scale
    params = [p for group in opt.param_groups for p in group["params"]]

    def step() -> None:
        opt.unscale(grads_scaled_by=S)
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step_after_unscale()

    return step


def third_party(module: str, name: str, **options: Any) -> Callable[[list[torch.Tensor]], Step]:
    """GradScaler around ``module.name(params, lr=1e-9, **options)`` (an optional package)."""
    optimizer_class = getattr(importlib.import_module(module), name)
    return lambda p: gradscaler(optimizer_class(p, lr=1e-9, **options))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


SGD = dict(lr=1e-9, momentum=0.9, weight_decay=0.01, nesterov=True)
ADAMW = dict(lr=1e-9, weight_decay=0.01)
ADAGRAD = dict(lr=1e-9, weight_decay=0.01)
NO_DECAY = dict(weight_decay=0.0)
# pytorch-optimizer's Lamb by default: no bias correction, no clipping, no weight decay, the
# trust ratio always (it also caps ||p|| at 10 and adds eps to ||update||).
LAMB_V3 = dict(weight_decay=0.0, bias_correction=False, max_grad_norm=0.0, use_nvlamb=True)
RMSPROP = dict(lr=1e-9, momentum=0.9, weight_decay=0.01, centered=False)
# The clip case's max_grad_norm: the unscaled grads (randn) have a norm of ~sqrt(numel), so
# every step clips.
CLIP = 1.0
Contenders = dict[str, tuple[torch.dtype, Callable[[list[torch.Tensor]], Step]]]


def _ours_and_gs(
    ours_class: type, torch_class: type, options: dict[str, Any], foreach: bool = True
) -> Contenders:
    """Ours against GradScaler around torch's fused (and ``foreach``: foreach) forms of the same
    optimizer."""
    contenders: Contenders = {
        "ours": (torch.float32, lambda p: ours(ours_class(p, **options))),
        "GS+fused": (torch.float32, lambda p: gradscaler(torch_class(p, **options, fused=True))),
    }
    if foreach:
        contenders["GS+foreach"] = (
            torch.float32,
            lambda p: gradscaler(torch_class(p, **options, foreach=True)),
        )
    return contenders


CASES: dict[str, Contenders] = {
    "AdamW": _ours_and_gs(scaledoptim.AdamW, torch.optim.AdamW, ADAMW),
    "AdamW-nowd": _ours_and_gs(
        scaledoptim.AdamW, torch.optim.AdamW, {**ADAMW, **NO_DECAY}, foreach=False
    ),
    "Adam": _ours_and_gs(scaledoptim.Adam, torch.optim.Adam, ADAMW),
    "Adam-nowd": _ours_and_gs(
        scaledoptim.Adam, torch.optim.Adam, {**ADAMW, **NO_DECAY}, foreach=False
    ),
    "Adagrad": _ours_and_gs(scaledoptim.Adagrad, torch.optim.Adagrad, ADAGRAD),
    "Adagrad-nowd": _ours_and_gs(
        scaledoptim.Adagrad, torch.optim.Adagrad, {**ADAGRAD, **NO_DECAY}, foreach=False
    ),
    "SGD": _ours_and_gs(scaledoptim.SGD, torch.optim.SGD, SGD),
    "SGD-nowd": _ours_and_gs(
        scaledoptim.SGD, torch.optim.SGD, {**SGD, **NO_DECAY}, foreach=False
    ),
    "RMSprop": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.RMSprop(p, **RMSPROP))),
        "GS+foreach": (
            torch.float32,
            lambda p: gradscaler(torch.optim.RMSprop(p, **RMSPROP, foreach=True)),
        ),
    },
    "Lion": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.Lion(p, lr=1e-9))),
        "GS+foreach": (torch.float32, lambda p: gradscaler(ForeachLion(p, lr=1e-9))),
        **(
            {"GS+lion-pytorch": (torch.float32, third_party("lion_pytorch", "Lion"))}
            if installed("lion_pytorch")
            else {}
        ),
        **(
            {
                "GS+pytorch-optimizer": (
                    torch.float32,
                    third_party("pytorch_optimizer", "Lion", foreach=True),
                )
            }
            if installed("pytorch_optimizer")
            else {}
        ),
    },
    "LAMB": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.LAMB(p, lr=1e-9))),
        "GS+foreach": (torch.float32, lambda p: gradscaler(ForeachLAMB(p, lr=1e-9))),
        **(
            {
                "GS+pytorch-optimizer": (
                    torch.float32,
                    third_party(
                        "pytorch_optimizer", "Lamb", foreach=True, weight_decay=0.01, pre_norm=True
                    ),
                )
            }
            if installed("pytorch_optimizer")
            else {}
        ),
    },
    "LAMB-v3": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.LAMB(p, lr=1e-9, **LAMB_V3))),
        **(
            {
                "GS+pytorch-optimizer": (
                    torch.float32,
                    third_party("pytorch_optimizer", "Lamb", foreach=True),
                )
            }
            if installed("pytorch_optimizer")
            else {}
        ),
    },
    "clip": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.AdamW(p, **ADAMW), clip=CLIP)),
        "GS+clip+fused": (
            torch.float32,
            lambda p: gradscaler(torch.optim.AdamW(p, **ADAMW, fused=True), clip=CLIP),
        ),
        "GS+clip+foreach": (
            torch.float32,
            lambda p: gradscaler(torch.optim.AdamW(p, **ADAMW, foreach=True), clip=CLIP),
        ),
        "ours-split": (
            torch.float32,
            lambda p: ours_split(scaledoptim.AdamW(p, **ADAMW), clip=CLIP),
        ),
    },
    "SR": {
        "ours": (
            torch.bfloat16,
            lambda p: ours(scaledoptim.AdamW(p, **ADAMW, stochastic_rounding=True)),
        ),
        "ours-nearest": (torch.bfloat16, lambda p: ours(scaledoptim.AdamW(p, **ADAMW))),
        "GS+fused-fp32": (
            torch.float32,
            lambda p: gradscaler(torch.optim.AdamW(p, **ADAMW, fused=True)),
        ),
    },
}


class Option:
    def __init__(self, name: str, dtype: torch.dtype, make: Callable[..., Step], sizes: list[int]):
        torch.manual_seed(0)
        self.name = name
        self.params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
        self.grads = [(torch.randn(n) * SCALE).to(dtype) for n in sizes]
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone()
        self.step = make(self.params)
        self.step()  # state allocation out of the timed steps
        self.times: list[float] = []

    def reset(self) -> None:
        torch._foreach_copy_([p.grad for p in self.params], self.grads)

    def timed(self) -> float:
        self.reset()
        start = CLOCK[0]()
        self.step()
        return CLOCK[0]() - start

    def transient_bytes_per_param(self) -> float:
        self.reset()
        return peak_transient_bytes(self.step) / sum(p.numel() for p in self.params)


Record = dict[str, Any]  # one option's times at one (case, shape): see measure()

#: Rows of two options of a case other than ours, the first over the second, labelled as the
#: table prints them: bf16 AdamW rounding to nearest against GS + fused AdamW on fp32 params,
#: and the split clipping form against GradScaler's clipping recipe around torch's fused AdamW.
BETWEEN = {
    "GS+fused-fp32, for ours-nearest": ("SR", "ours-nearest", "GS+fused-fp32"),
    "GS+clip+fused, for ours-split": ("clip", "ours-split", "GS+clip+fused"),
}


def measure(case: str, shape: str, rounds: int, reps: int) -> list[Record]:
    """Each option's median step time per repetition (seconds) and its transient bytes/param;
    the case's first option (ours) first. Progress goes to stderr (stdout carries the JSON of
    ``--one-process``)."""
    gc.collect()  # the previous case's optimizers (reference cycles) out of this one's heap
    sizes = SHAPES[shape]()
    options = [Option(name, dtype, make, sizes) for name, (dtype, make) in CASES[case].items()]
    medians: dict[str, list[float]] = {o.name: [] for o in options}
    for _ in range(reps):
        times: dict[str, list[float]] = {o.name: [] for o in options}
        for round_ in range(rounds):
            first = round_ % len(options)  # rotated: see the module's docstring
            for option in options[first:] + options[:first]:
                times[option.name].append(option.timed())
        for name, values in times.items():
            medians[name].append(statistics.median(values))
    records = []
    for option in options:
        transient = option.transient_bytes_per_param()
        ms = statistics.median(medians[option.name]) * 1e3
        print(f"{case:<7} {shape:<8} {option.name:<20} {ms:9.2f} ms  +{transient:5.1f} B/param",
              file=sys.stderr, flush=True)
        records.append(dict(case=case, shape=shape, option=option.name,
                            seconds=medians[option.name], bytes_per_param=transient))
    return records


def measure_all(args: argparse.Namespace) -> list[Record]:
    """Every case at every shape, in this process."""
    return [record for case in args.cases for shape in args.shapes
            for record in measure(case, shape, args.rounds, args.reps)]


def run_ratios(records: list[Record]) -> dict[tuple[str, str, str], list[float]]:
    """ours / alternative per repetition of one run, by (case, shape, alternative); ours is
    the first option of each (case, shape)."""
    base: dict[tuple[str, str], Record] = {}
    ratios = {}
    for r in records:
        ours = base.setdefault((r["case"], r["shape"]), r)
        if ours is not r:
            ratios[r["case"], r["shape"], r["option"]] = [
                a / b for a, b in zip(ours["seconds"], r["seconds"])
            ]
    seconds = {(r["case"], r["shape"], r["option"]): r["seconds"] for r in records}
    for label, (case, top, bottom) in BETWEEN.items():  # see BETWEEN
        for shape in {shape for c, shape, _ in seconds if c == case}:
            if (case, shape, top) in seconds and (case, shape, bottom) in seconds:
                pairs = zip(seconds[case, shape, top], seconds[case, shape, bottom])
                ratios[case, shape, label] = [a / b for a, b in pairs]
    return ratios


def cell(values: list[float], tolerance: float = DISAGREEMENT) -> str:
    """``median [min-max]`` of one cell's values; when the largest is more than ``tolerance``
    over the smallest, the range and why: ``bimodal: a / b`` (the medians of the two groups
    either side of the largest gap between neighbours, when that gap alone is over the
    tolerance) or ``spread: v1 / v2 / ...`` (a drift, no gap that large)."""
    values = sorted(values)
    low, high = values[0], values[-1]
    if high <= low * (1 + tolerance):
        median = f"{statistics.median(values):.2f}"
        return median if f"{low:.2f}" == f"{high:.2f}" else f"{median} [{low:.2f}-{high:.2f}]"
    gap = max(range(len(values) - 1), key=lambda i: values[i + 1] / values[i])
    if values[gap + 1] > values[gap] * (1 + tolerance):
        groups = (values[: gap + 1], values[gap + 1 :])
        why = "bimodal: " + " / ".join(f"{statistics.median(g):.2f}" for g in groups)
    else:
        why = "spread: " + " / ".join(f"{v:.2f}" for v in values)
    return f"{low:.2f}-{high:.2f} ({why})"


def span(values: list[float]) -> str:
    """The range of transient bytes/param, one decimal: ``0.0`` or ``0.1-1.6``."""
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return low if low == high else f"{low}-{high}"


def table(runs: list[list[Record]], shapes: list[str]) -> list[str]:
    """The table of docs/performance.md: a row per (case, alternative), a column per shape.

    With one run (one process), a cell's values are its repetitions' ratios; with several runs
    (``--processes``), each run's median ratio over its repetitions, one value per process.
    """
    per_run = [run_ratios(records) for records in runs]
    if len(runs) == 1:
        values = per_run[0]
    else:
        values = {key: [statistics.median(r[key]) for r in per_run] for key in per_run[0]}
    memory: dict[tuple[str, str], list[float]] = {}
    ours: dict[str, str] = {}  # each case's first option
    for record in (record for records in runs for record in records):
        ours.setdefault(record["case"], record["option"])
        memory.setdefault((record["case"], record["option"]), []).append(record["bytes_per_param"])
    rows = dict.fromkeys((case, option) for case, _, option in values)  # first seen, in order
    lines = [
        f"| optimizer | alternative | {' | '.join(shapes)} | ours B/param | alt. B/param |",
        "|---|---|" + "---|" * len(shapes) + "---|---|",
    ]
    for case, option in rows:
        cells = [cell(values[case, shape, option]) for shape in shapes]
        _, mine, theirs = BETWEEN.get(option, (case, ours[case], option))
        lines.append(
            f"| {case} | {option} | {' | '.join(cells)} | "
            f"{span(memory[case, mine])} | {span(memory[case, theirs])} |"
        )
    return lines


def environment(threads: int) -> list[str]:
    """What the figures depend on: the software, the CPU, the threads, the time."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    versions = [f"torch {torch.__version__}", f"Python {platform.python_version()}"]
    for package in ("scaledoptim", "lion-pytorch", "pytorch-optimizer"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return [
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"software: {', '.join(versions)}; {platform.platform()}",
        f"CPU: {cpu}, {os.cpu_count()} logical cores; torch threads: {threads}",
    ]


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def fresh_processes(args: argparse.Namespace) -> list[list[Record]]:
    """One run per process, one after the other: ``--one-process`` with the same options."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--one-process", "--cases", *args.cases,
        "--shapes", *args.shapes, "--rounds", str(args.rounds), "--reps", str(args.reps),
        "--threads", str(args.threads), "--clock", args.clock,
    ]
    runs = []
    for process in range(args.processes):
        print(f"process {process + 1} of {args.processes}; {load_average()}", flush=True)
        child = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(child.stdout.splitlines()[-1]))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--shapes", nargs="+", default=["500x10k", "2000x1k"], choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions per process (default: 3, or 1 with --processes)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="time steps by the wall clock, or by this thread's CPU time (a loaded machine)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="run each repetition set in N fresh processes, one after the other",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="also write the run (environment, load, every record) to this file, for "
        "benchmarks/plot_performance.py",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="(used by --processes) print this process's times as JSON",
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "reps", "threads", "processes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.processes is not None and args.one_process:
        parser.error("--processes spawns --one-process children: give one or the other")
    if args.reps is None:
        args.reps = 1 if args.processes is not None else 3
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    CLOCK[0] = CLOCKS[args.clock]
    if args.one_process:
        print(json.dumps(measure_all(args)))
        return
    start = time.perf_counter()
    print("\n".join(environment(args.threads)))
    loads = [load_average()]
    print(f"at the start, {loads[0]}", flush=True)
    if args.processes is None:
        runs = [measure_all(args)]
        over = f"{args.reps} repetitions in one process"
    else:
        runs = fresh_processes(args)
        over = f"{args.processes} fresh processes ({args.reps} repetition(s) each)"
    loads.append(load_average())
    print(f"at the end, {loads[-1]}; {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "python benchmarks/cpu_step_ratios.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "environment": environment(args.threads), "load": {"start": loads[0],
            "end": loads[-1]}, "seconds": time.perf_counter() - start, "shapes": args.shapes,
            "runs": runs,
        }, indent=1))
    print(f"\nours / alternative, median [min-max] over {over} of {args.rounds} rotated rounds "
          f"each, {args.threads} thread(s), {args.clock} clock; < 1: ours is faster; a cell "
          f"whose values disagree "
          f"by more than {DISAGREEMENT:.0%} is the range with the reason")
    print("\n".join(table(runs, args.shapes)))


if __name__ == "__main__":
    main()
