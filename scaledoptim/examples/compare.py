"""Runs the variants interleaved, step by step, and prints one comparison table per task.

Interleaving (A B C A B C ...) in one process means slow spells of a shared machine hit every
variant alike, so per-step timings are compared pairwise, round by round, and a difference
smaller than the rounds' spread is reported as noise rather than as a ranking.

On a CPU the runs use one intra-op thread (``RunConfig.threads``): the small CPU models gain
nothing from more, and on a machine busy with other jobs torch's default (a thread per core)
made the demo 5-10x slower than on a quiet one, as each op waited for threads without a core.
"""

from __future__ import annotations

import dataclasses
import statistics
import textwrap
from collections.abc import Callable
from typing import Protocol

import torch

from .train import Run, RunConfig, RunResult, cpu_threads

REFRESH_EVERY = 25  # the progress bar reads loss and scale on the host this often, no more


class Bar(Protocol):
    """What the demo asks of a progress bar (tqdm's)."""

    def update(self, n: int) -> object: ...
    def set_postfix_str(self, s: str) -> object: ...
    def close(self) -> object: ...


Progress = Callable[[int, str], Bar]  # (total, description) -> a tqdm-like bar


def run_interleaved(
    config: RunConfig, variants: list[str], progress: Progress | None = None
) -> list[RunResult]:
    """The same task, seed and length trained once per variant, a step of each in turn."""
    with cpu_threads(config):
        runs = [Run(dataclasses.replace(config, variant=v)) for v in variants]
        steps = runs[0].steps
        bar = progress(steps, runs[0].task.name) if progress else None
        for i in range(steps):
            for run in runs:
                run.step()
            if bar is not None:
                bar.update(1)
                if i % REFRESH_EVERY == 0 or i == steps - 1:
                    loss, scale, _ = runs[-1].history[-1]
                    bar.set_postfix_str(
                        f"{runs[-1].config.variant}: loss {loss.item():.3f}, scale "
                        + ("-" if scale is None else f"{scale.item():.0f}")
                    )
        if bar is not None:
            bar.close()
        return [run.result() for run in runs]


def relative_gap(result: RunResult, baseline: RunResult) -> float:
    """How far ``result``'s final loss is from ``baseline``'s, as a fraction of the latter."""
    return abs(result.final_loss - baseline.final_loss) / baseline.final_loss


@dataclasses.dataclass(frozen=True)
class TimingVerdict:
    """``ours`` minus ``theirs`` per step, from rounds timed back to back."""

    difference_ms: float  # median of the per-round differences
    spread_ms: float  # half their interquartile range

    @property
    def within_noise(self) -> bool:
        return abs(self.difference_ms) <= self.spread_ms

    def describe(self, what: str, ours: str, theirs: str) -> str:
        if self.within_noise:
            return (f"{what}: {ours} vs {theirs} within noise (difference "
                    f"{self.difference_ms:+.2f} ms, spread ±{self.spread_ms:.2f} ms)")
        faster = "faster" if self.difference_ms < 0 else "slower"
        return (f"{what}: {ours} {abs(self.difference_ms):.2f} ms/step {faster} than {theirs} "
                f"(spread ±{self.spread_ms:.2f} ms)")


def paired_difference(ours: list[float], theirs: list[float]) -> TimingVerdict:
    """Compares two runs' per-step timings round by round, so drift common to both cancels."""
    differences = [a - b for a, b in zip(ours, theirs)]
    if len(differences) < 4:
        return TimingVerdict(statistics.median(differences), float("inf"))
    q1, _, q3 = statistics.quantiles(differences, n=4)
    return TimingVerdict(statistics.median(differences), (q3 - q1) / 2)


def format_table(results: list[RunResult]) -> str:
    """A plain-text table: held-out loss, step times, host reads, skips or replays, scale."""
    first = results[0]
    lbfgs = any(r.evaluations for r in results)
    extra = f"{'evals':>6} {'replays':>7}" if lbfgs else f"{'skipped':>7}"
    header = (f"{'variant':<18} {'held-out loss':>13} {'iter ms':>8} {'optim ms':>8} "
              f"{'host reads/step':>15} {extra} {'final scale':>11}")
    lines = [
        (
            f"{first.config.task} ({first.title}): {first.parameters:,} parameters, "
            f"{first.items_per_batch:,} {first.unit}/batch, {len(first.losses)} steps, "
            f"{first.config.dtype} autocast on {_device(first.config)}, seed {first.config.seed}"
        ),
        header,
        "-" * len(header),
    ]
    for r in results:
        scale = f"{r.scales[-1]:.0f}" if r.scales else "-"
        counts = (f"{r.evaluations:>6} {sum(r.replays):>7}" if lbfgs
                  else f"{sum(r.skipped):>7}")
        lines.append(
            f"{r.label:<18} {r.final_loss:>13.4f} {r.median_iteration_ms:>8.2f} "
            f"{r.median_optimizer_ms:>8.2f} {r.host_reads_per_step:>15.1f} {counts} {scale:>11}"
        )
    lines.append("iter/optim ms: medians per step (whole iteration / optimizer phase), variants "
                 "interleaved step by step; host reads: .item(), bool(), .cpu(), ... in the "
                 "optimizer phase")
    if lbfgs:
        lines.append(_lbfgs_reads(results))
    else:
        lines += [f"skipped steps of {r.label}: {skipped_steps(r)}" for r in results if r.scales]
    lines += _comparisons({r.label: r for r in results})
    return "\n".join(lines)


def skipped_steps(result: RunResult) -> str:
    """The steps ``result`` skipped, numbered from 0 as on the plot's step axis."""
    steps = [str(i) for i, skipped in enumerate(result.skipped) if skipped]
    return ", ".join(steps) if steps else "none"


def _device(config: RunConfig) -> str:
    if torch.device(config.device).type != "cpu":
        return config.device
    threads = torch.get_num_threads() if config.threads is None else config.threads
    return f"{config.device} ({threads} thread{'s' if threads != 1 else ''})"


def _lbfgs_reads(results: list[RunResult]) -> str:
    """Whose host reads the LBFGS rows count, as measured: torch's LBFGS reads the host itself,
    and scaledoptim's closure replay reads ``found_inf`` to decide whether to replay."""
    parts = []
    for r in results:
        lbfgs = r.host_reads_by_module.get("torch.optim.lbfgs", 0.0)
        ours = sum(n for m, n in r.host_reads_by_module.items() if m.startswith("scaledoptim."))
        part = f"{r.label} {lbfgs:.1f} by LBFGS"
        if ours:
            part += f" + {ours:.1f} by the replay ({ours / r.evaluations_per_step:.1f}/evaluation)"
        elsewhere = sum(n for m, n in r.host_reads_by_module.items()
                        if m != "torch.optim.lbfgs" and not m.startswith("scaledoptim."))
        if elsewhere:
            part += f" + {elsewhere:.1f} elsewhere"
        parts.append(part)
    return textwrap.fill(
        "host reads (LBFGS): torch.optim.LBFGS reads the host itself at every evaluation and "
        "iteration (the loss as a float, the tests of its line search and stopping rules); "
        "scaledoptim's closure replay reads the scale it tries and found_inf at each "
        "evaluation, to decide whether to replay it (and the backed-off scale at a replay), "
        "and each replay is one more evaluation (counted in evals). Per step: " + "; ".join(parts),
        width=110,
    )


def _comparisons(by_variant: dict[str, RunResult]) -> list[str]:
    pairs = [(ours, theirs) for ours, theirs in (
        ("scaledoptim", "fp32"), ("scaledoptim", "torch.amp"), ("torch.amp", "fp32"),
        ("scaledoptim-lbfgs", "fp32-lbfgs"),
    ) if ours in by_variant and theirs in by_variant]
    lines = [
        f"{ours} held-out loss vs {theirs}: "
        f"{relative_gap(by_variant[ours], by_variant[theirs]):.2%} apart"
        for ours, theirs in pairs
    ]
    if ("scaledoptim", "torch.amp") in pairs:  # the fp32 runs do other arithmetic
        a, b = by_variant["scaledoptim"], by_variant["torch.amp"]
        for what, field in (("optimizer phase", "optimizer_ms"), ("iteration", "iteration_ms")):
            verdict = paired_difference(getattr(a, field), getattr(b, field))
            lines.append(verdict.describe(what, "scaledoptim", "torch.amp"))
    return lines


def gradscaler_refusal(device: str) -> str:
    """What ``GradScaler.step`` says when given LBFGS's closure (it raises, as of torch 2.13)."""
    model = torch.nn.Linear(2, 1, device=device)
    opt = torch.optim.LBFGS(model.parameters())
    scaler = torch.amp.GradScaler(torch.device(device).type)
    scaler.scale(model(torch.ones(1, 2, device=device)).sum()).backward()
    try:
        scaler.step(opt, closure=lambda: model(torch.ones(1, 2, device=device)).sum())
    except RuntimeError as error:
        return f"torch.amp: GradScaler.step(LBFGS, closure) raises RuntimeError: {error}"
    return "torch.amp: GradScaler.step(LBFGS, closure) ran (this torch supports closures)"
