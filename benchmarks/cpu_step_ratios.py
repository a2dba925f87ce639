"""CPU step time and transient memory of scaledoptim against the best alternative, in one run.

Each case (optimizer, shape) builds every option over its own copy of the same params and
scaled grads (2**16), then times one step per option per round, interleaved, with the grads
restored before every step; each round starts one option later than the one before (A B C,
B C A, C A B, ...), so that no option always runs first, or always right after the same other; a repetition's time of an option is its median over the rounds,
and the ratio ours / alternative is printed as the median over the repetitions with its
range (< 1: ours is faster). Transient memory is the peak of the CPU allocations alive during
one step, over what was alive before it (torch's profiler), in bytes per param. It ends with
one table: optimizer x shape x alternative, ratios with their range, transient bytes/param.

    python benchmarks/cpu_step_ratios.py [--cases AdamW Adagrad SGD RMSprop Lion LAMB clip SR]
        [--shapes 1x25M 500x10k 2000x1k char-lm]
        [--rounds 15] [--reps 3] [--threads 1]

What each option's timed step runs:
    ours: ``opt.unscale_and_step(grads_scaled_by=S)`` (the unscale, the inf check and the
        update, skipping on inf).
    GS + X: ``scaler.step(X)`` then ``scaler.update()`` with a ``torch.amp.GradScaler``; no
        separate ``unscale_`` call. ``scaler.step`` unscales the grads itself: for a foreach
        or for-loop X with ``_amp_foreach_non_finite_check_and_unscale_``, then reads
        ``found_inf`` on the host and calls ``X.step()``; for a fused torch X it hands
        ``grad_scale`` and ``found_inf`` to the fused step, which unscales and skips inside.

The options per case:
    AdamW, Adagrad, SGD (nesterov, momentum 0.9, weight decay 0.01): ours, GS + torch fused,
        GS + torch foreach.
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
        ``opt.unscale`` + ``clip_grad_norm_`` + ``opt.step_after_unscale()``.
    SR (AdamW on bf16 params): ours with stochastic rounding, ours rounding to nearest,
        GS + torch fused AdamW on fp32 params.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import statistics
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
# pytorch-optimizer's Lamb by default: no bias correction, no clipping, no weight decay, the
# trust ratio always (it also caps ||p|| at 10 and adds eps to ||update||).
LAMB_V3 = dict(weight_decay=0.0, bias_correction=False, max_grad_norm=0.0, use_nvlamb=True)
RMSPROP = dict(lr=1e-9, momentum=0.9, weight_decay=0.01, centered=False)
# The clip case's max_grad_norm: the unscaled grads (randn) have a norm of ~sqrt(numel), so
# every step clips.
CLIP = 1.0
CASES: dict[str, dict[str, tuple[torch.dtype, Callable[[list[torch.Tensor]], Step]]]] = {
    "AdamW": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.AdamW(p, **ADAMW))),
        "GS+fused": (torch.float32, lambda p: gradscaler(torch.optim.AdamW(p, **ADAMW, fused=True))),
        "GS+foreach": (torch.float32,
                       lambda p: gradscaler(torch.optim.AdamW(p, **ADAMW, foreach=True))),
    },
    "Adagrad": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.Adagrad(p, **ADAGRAD))),
        "GS+fused": (torch.float32,
                     lambda p: gradscaler(torch.optim.Adagrad(p, **ADAGRAD, fused=True))),
        "GS+foreach": (torch.float32,
                       lambda p: gradscaler(torch.optim.Adagrad(p, **ADAGRAD, foreach=True))),
    },
    "SGD": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.SGD(p, **SGD))),
        "GS+fused": (torch.float32, lambda p: gradscaler(torch.optim.SGD(p, **SGD, fused=True))),
        "GS+foreach": (torch.float32, lambda p: gradscaler(torch.optim.SGD(p, **SGD, foreach=True))),
    },
    "RMSprop": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.RMSprop(p, **RMSPROP))),
        "GS+foreach": (torch.float32,
                       lambda p: gradscaler(torch.optim.RMSprop(p, **RMSPROP, foreach=True))),
    },
    "Lion": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.Lion(p, lr=1e-9))),
        "GS+foreach": (torch.float32, lambda p: gradscaler(ForeachLion(p, lr=1e-9))),
        **({"GS+lion-pytorch": (torch.float32, third_party("lion_pytorch", "Lion"))}
           if installed("lion_pytorch") else {}),
        **({"GS+pytorch-optimizer": (torch.float32,
                                     third_party("pytorch_optimizer", "Lion", foreach=True))}
           if installed("pytorch_optimizer") else {}),
    },
    "LAMB": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.LAMB(p, lr=1e-9))),
        "GS+foreach": (torch.float32, lambda p: gradscaler(ForeachLAMB(p, lr=1e-9))),
        **({"GS+pytorch-optimizer": (torch.float32, third_party(
                "pytorch_optimizer", "Lamb", foreach=True, weight_decay=0.01, pre_norm=True))}
           if installed("pytorch_optimizer") else {}),
    },
    "LAMB-v3": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.LAMB(p, lr=1e-9, **LAMB_V3))),
        **({"GS+pytorch-optimizer": (torch.float32,
                                     third_party("pytorch_optimizer", "Lamb", foreach=True))}
           if installed("pytorch_optimizer") else {}),
    },
    "clip": {
        "ours": (torch.float32, lambda p: ours(scaledoptim.AdamW(p, **ADAMW), clip=CLIP)),
        "GS+clip+fused": (torch.float32, lambda p: gradscaler(
            torch.optim.AdamW(p, **ADAMW, fused=True), clip=CLIP)),
        "GS+clip+foreach": (torch.float32, lambda p: gradscaler(
            torch.optim.AdamW(p, **ADAMW, foreach=True), clip=CLIP)),
        "ours-split": (torch.float32,
                       lambda p: ours_split(scaledoptim.AdamW(p, **ADAMW), clip=CLIP)),
    },
    "SR": {
        "ours": (torch.bfloat16,
                 lambda p: ours(scaledoptim.AdamW(p, **ADAMW, stochastic_rounding=True))),
        "ours-nearest": (torch.bfloat16, lambda p: ours(scaledoptim.AdamW(p, **ADAMW))),
        "GS+fused-fp32": (torch.float32,
                          lambda p: gradscaler(torch.optim.AdamW(p, **ADAMW, fused=True))),
    },
}  # fmt: skip


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
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start

    def transient_bytes_per_param(self) -> float:
        self.reset()
        return peak_transient_bytes(self.step) / sum(p.numel() for p in self.params)


TABLE: list[str] = []


def run_case(case: str, shape: str, rounds: int, reps: int) -> None:
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
    transient = {o.name: o.transient_bytes_per_param() for o in options}
    base = options[0].name
    for option in options:
        ms = statistics.median(medians[option.name]) * 1e3
        line = f"{case:<5} {shape:<8} {option.name:<14} {ms:9.2f} ms  +{transient[option.name]:5.1f} B/param"
        if option.name != base:
            ratios = [a / b for a, b in zip(medians[base], medians[option.name])]
            ratio = (f"{statistics.median(ratios):.2f} "
                     f"[{min(ratios):.2f}-{max(ratios):.2f}]")  # fmt: skip
            line += f"   {base}/{option.name} {ratio}"
            TABLE.append(
                f"| {case} | {shape} | {option.name} | {ratio} | "
                f"{transient[base]:.1f} | {transient[option.name]:.1f} |"
            )
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--shapes", nargs="+", default=["500x10k", "2000x1k"], choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for case in args.cases:
        for shape in args.shapes:
            run_case(case, shape, args.rounds, args.reps)
    print(f"\nours / alternative, median [range] of {args.reps} repetitions of {args.rounds} "
          f"interleaved rounds, {args.threads} thread(s); < 1: ours is faster")  # fmt: skip
    print("| optimizer | shape | alternative | ours / alternative | ours B/param | alt. B/param |")
    print("|---|---|---|---|---|---|")
    print("\n".join(TABLE))


if __name__ == "__main__":
    main()
