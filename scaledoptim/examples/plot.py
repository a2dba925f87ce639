"""Writes the comparison figure: per task, loss curves, the loss scale with skipped steps and
replays marked, and the host reads per step of each variant."""

from __future__ import annotations

import pathlib

from .deps import install_hint
from .train import LBFGS_INIT_SCALE, RunResult

STYLES = {
    "fp32": {"linewidth": 1.5, "color": "tab:blue", "zorder": 2},
    "scaledoptim": {"linewidth": 3.5, "alpha": 0.6, "color": "tab:orange", "zorder": 1},
    "torch.amp": {"linewidth": 1.2, "linestyle": "--", "color": "black", "zorder": 3},
    "fp32-lbfgs": {"linewidth": 1.5, "color": "tab:blue", "zorder": 2},
    "scaledoptim-lbfgs": {"linewidth": 3.5, "alpha": 0.6, "color": "tab:orange", "zorder": 1},
}
# Skips of torch.amp and scaledoptim may fall on the same steps: a large hollow circle around
# a small cross keeps both visible where they coincide.
MARKERS = {
    "torch.amp": {"marker": "x", "s": 30, "color": "black", "zorder": 5},
    "scaledoptim": {"marker": "o", "s": 110, "facecolors": "none", "edgecolors": "tab:orange",
                    "linewidths": 1.8, "zorder": 4},
}
REPLAY_MARKER = {"marker": "^", "s": 60, "color": "tab:red", "zorder": 5}
SMOOTHING = 0.9  # exponential moving average of the per-step training loss, for readability
LBFGS_SCALE_NOTE = (
    "scaledoptim-lbfgs starts at 2^24 on purpose: far too large for fp16,\n"
    "so the first closure evaluations overflow and the replay shows"
)


def _smoothed(values: list[float]) -> list[float]:
    out, average = [], values[0]
    for v in values:
        average = SMOOTHING * average + (1 - SMOOTHING) * v
        out.append(average)
    return out


def write_plot(results_by_task: dict[str, list[RunResult]], path: pathlib.Path) -> None:
    """One column per task: training loss, loss scale (log2) with skips/replays, host reads."""
    plt = _pyplot()
    fig = make_figure(results_by_task)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: works on machines without a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            f"--plot needs matplotlib: {install_hint('plot')} (or pip install matplotlib)"
        ) from None
    return plt


def make_figure(results_by_task: dict[str, list[RunResult]]):
    """The figure :func:`write_plot` writes, a ``matplotlib.figure.Figure``: a column per task."""
    plt = _pyplot()
    columns = len(results_by_task)
    fig, axes = plt.subplots(
        3, columns, figsize=(6.5 * columns, 9), squeeze=False,
        gridspec_kw={"height_ratios": [3, 2, 1.1]},
    )
    for column, (task, results) in enumerate(results_by_task.items()):
        _loss_panel(axes[0, column], task, results)
        _scale_panel(axes[1, column], results)
        _reads_panel(axes[2, column], results)
    fig.tight_layout()
    return fig


def _loss_panel(ax, task: str, results: list[RunResult]) -> None:
    first = results[0]
    full_batch = any(r.evaluations for r in results)  # one fixed batch: no noise to smooth
    curves = [r.losses if full_batch else _smoothed(r.losses) for r in results]
    for r, curve in zip(results, curves):
        ax.plot(curve, label=r.label, **STYLES.get(r.label, {}))
    ax.set_title(f"{task} ({first.title}): {first.parameters:,} params,\n"
                 f"{first.config.dtype} autocast on {first.config.device}")
    # A log axis shows the first steps' loss and the end of training on one panel (LBFGS
    # drops by orders of magnitude in a few steps); the limits hold every curve whole.
    ax.set_yscale("log")
    low, high = min(min(c) for c in curves), max(max(c) for c in curves)
    ax.set_ylim(low / 1.1, high * 1.1)
    ax.set_ylabel("training loss" + ("" if full_batch else " (smoothed)"))
    ax.set_xlabel("step")
    ax.legend(fontsize=8, title="training loss", title_fontsize=8, loc="upper right")
    # The held-out loss is one number per run, measured after training: beside the curves,
    # not in the training-loss legend.
    held_out = "\n".join(f"{r.label}: {r.final_loss:.4f}" for r in results)
    # Where the curves are not: below a falling curve's start, or above LBFGS's fast drop.
    x, y = (0.3, 0.55) if full_batch else (0.02, 0.03)
    ax.text(x, y, f"held-out loss after training\n{held_out}", transform=ax.transAxes,
            fontsize=7, va="bottom", bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    ax.grid(alpha=0.3, which="both")


def _scale_panel(ax, results: list[RunResult]) -> None:
    marked = []  # what this panel's markers mean, for its axis label
    for r in results:
        if not r.scales:
            continue
        style = {k: v for k, v in STYLES.get(r.label, {}).items() if k != "zorder"}
        ax.plot(r.scales, label=f"{r.label} scale", drawstyle="steps-post", **style)
        skips = [i for i, skipped in enumerate(r.skipped) if skipped]
        if r.label in MARKERS:
            ax.scatter(skips, [r.scales[i] for i in skips], **MARKERS[r.label],
                       label=f"{r.label}: {len(skips)} skipped")
            marked.append(f"{MARKERS[r.label]['marker']}: {r.label} skipped")
        replayed = [i for i, n in enumerate(r.replays) if n]
        if replayed:
            ax.scatter(replayed, [r.scales[i] for i in replayed], **REPLAY_MARKER,
                       label=f"{r.label}: {sum(r.replays)} replays")
            for i in replayed:
                ax.annotate(f"{r.replays[i]}", (i, r.scales[i]), textcoords="offset points",
                            xytext=(4, 6), fontsize=7, color="tab:red")
            marked.append("^: evaluations replayed (how many beside)")
        if r.evaluations and r.scales[0] == LBFGS_INIT_SCALE:
            # Above the panel, not in it: inside, it hid the replay counts of the first steps.
            ax.set_title(LBFGS_SCALE_NOTE, fontsize=7)
    if ax.has_data():
        ax.set_yscale("log", base=2)
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no loss scale (unscaled runs)", ha="center", transform=ax.transAxes)
    ax.set_ylabel("loss scale at step start")
    ax.set_xlabel("step" + (f" ({'; '.join(marked)})" if marked else ""))
    ax.grid(alpha=0.3)


def _reads_panel(ax, results: list[RunResult]) -> None:
    labels = [r.label for r in results]
    reads = [r.host_reads_per_step for r in results]
    colors = [STYLES.get(label, {}).get("color", "gray") for label in labels]
    bars = ax.barh(labels, reads, color=colors, alpha=0.7)
    ax.bar_label(bars, labels=[f"{v:.1f}" for v in reads], padding=3, fontsize=8)
    ax.set_xlim(right=max(max(reads), 1.0) * 1.25)
    ax.invert_yaxis()  # the same order as the tables
    ax.set_xlabel("host reads per step in the optimizer phase (each a GPU sync on a GPU)")
    ax.tick_params(axis="y", labelsize=8)
