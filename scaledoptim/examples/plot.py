"""Writes the comparison figure: loss curves per task, and the loss scale with skipped steps."""

from __future__ import annotations

import pathlib

from .train import RunResult

STYLES = {
    "fp32": {"linewidth": 1.5, "color": "tab:blue", "zorder": 2},
    "scaledoptim": {"linewidth": 3.5, "alpha": 0.6, "color": "tab:orange", "zorder": 1},
    "torch.amp": {"linewidth": 1.2, "linestyle": "--", "color": "black", "zorder": 3},
}
SMOOTHING = 0.9  # exponential moving average of the per-step training loss, for readability


def _smoothed(values: list[float]) -> list[float]:
    out, average = [], values[0]
    for v in values:
        average = SMOOTHING * average + (1 - SMOOTHING) * v
        out.append(average)
    return out


def write_plot(results_by_task: dict[str, list[RunResult]], path: pathlib.Path) -> None:
    """One column per task: training loss on top, loss scale (log2) below, skips marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: works on machines without a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'scaledoptim[plot]' (or pip install matplotlib)"
        ) from None

    fig, axes = plt.subplots(
        2, len(results_by_task), figsize=(6.5 * len(results_by_task), 7), squeeze=False,
        sharex="col", gridspec_kw={"height_ratios": [3, 2]},
    )  # fmt: skip
    for column, (task, results) in enumerate(results_by_task.items()):
        loss_ax, scale_ax = axes[0, column], axes[1, column]
        for r in results:
            # torch.amp and scaledoptim usually coincide: draw torch.amp thin and dashed on top
            style = STYLES.get(r.config.variant, {})
            loss_ax.plot(
                _smoothed(r.losses), label=f"{r.config.variant} (final {r.final_loss:.3f})", **style
            )
            if not r.scales:
                continue
            line = scale_ax.plot(r.scales, label=r.config.variant, drawstyle="steps-post", **style)[0]
            skips = [i for i, skipped in enumerate(r.skipped) if skipped]
            scale_ax.scatter(
                skips, [r.scales[i] for i in skips], marker="x", color=line.get_color(),
                zorder=3, label=f"{r.config.variant}: {len(skips)} skipped",
            )  # fmt: skip
        first = results[0]
        loss_ax.set_title(f"{task}: {first.parameters:,} params, {first.config.dtype} autocast on "
                          f"{first.config.device}")  # fmt: skip
        loss_ax.set_ylim(top=_smoothed(first.losses)[len(first.losses) // 10] * 1.2)  # the tail
        loss_ax.set_ylabel("training loss (smoothed)")
        loss_ax.legend()
        loss_ax.grid(alpha=0.3)
        scale_ax.set_yscale("log", base=2)
        scale_ax.set_ylabel("loss scale (x: skipped step)")
        scale_ax.set_xlabel("step")
        scale_ax.grid(alpha=0.3)
        if scale_ax.has_data():
            scale_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
