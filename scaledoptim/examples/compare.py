"""Runs each variant in a fresh process and prints one comparison table per task."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing

from .train import RunConfig, RunResult, train

BASELINES = ("fp32", "torch.amp")  # scaledoptim's final loss is compared against these


def run_isolated(config: RunConfig) -> RunResult:
    """Trains in a freshly spawned process, so its peak memory is its own and no run warms
    caches (allocator, autocast, thread pools) for the next one."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(train, config).result()


def run_variants(config: RunConfig, variants: list[str]) -> list[RunResult]:
    """The same task, seed and length trained once per variant, one after another."""
    return [run_isolated(dataclasses.replace(config, variant=v)) for v in variants]


def relative_gap(result: RunResult, baseline: RunResult) -> float:
    """How far ``result``'s final loss is from ``baseline``'s, as a fraction of the latter."""
    return abs(result.final_loss - baseline.final_loss) / baseline.final_loss


def format_table(results: list[RunResult]) -> str:
    """A plain-text table: loss, throughput, skipped steps, final scale and peak memory."""
    first = results[0]
    memory = "peak MB (CUDA alloc)" if first.config.device.startswith("cuda") else "peak RSS MB"
    header = (
        f"{'variant':<18} {'steps':>5} {'final loss':>10} {first.unit + '/s':>10} "
        f"{'skipped':>7} {'final scale':>11} {memory:>20}"
    )
    lines = [
        f"{first.config.task}: {first.parameters:,} parameters, {first.config.dtype} autocast "
        f"on {first.config.device}, seed {first.config.seed}; final loss = fp32 eval on "
        "held-out batches",
        header,
        "-" * len(header),
    ]
    for r in results:
        scale = f"{r.scales[-1]:.0f}" if r.scales else "-"
        lines.append(
            f"{r.config.variant:<18} {len(r.losses):>5} {r.final_loss:>10.4f} "
            f"{r.items_per_second:>10,.0f} {sum(r.skipped):>7} {scale:>11} "
            f"{r.peak_memory_mb:>20,.0f}"
        )
    by_variant = {r.config.variant: r for r in results}
    if "scaledoptim" in by_variant:
        for name in BASELINES:
            if name in by_variant:
                gap = relative_gap(by_variant["scaledoptim"], by_variant[name])
                lines.append(f"scaledoptim final loss vs {name}: {gap:.2%} apart")
    return "\n".join(lines)
