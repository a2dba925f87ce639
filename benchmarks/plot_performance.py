"""The plots and tables of docs/performance.md, from the JSON of a ``cpu_step_ratios.py`` run.

    python benchmarks/cpu_step_ratios.py ... --json benchmarks/results/cpu_step_ratios.json
    python benchmarks/plot_performance.py benchmarks/results/cpu_step_ratios.json

writes three figures into ``docs/images/`` and rewrites the generated parts of
docs/performance.md (between ``<!-- generated: NAME -->`` and ``<!-- /generated: NAME -->``),
each a table of the figure's numbers and the command and machine that made them:

* ``cpu_step_ratios.png`` (``ratios``): ours / the best alternative, per optimizer and shape;
  the best alternative of a case at a shape is the one with the shortest step there (options
  named ``ours-...`` are our own, not alternatives). Bars are medians over the processes
  (``--processes``) or repetitions, whiskers their range.
* ``clipping.png`` (``clipping``): the clipping loop (AdamW with global-norm clipping to 1.0),
  milliseconds per step of ours, our split form and GradScaler + ``clip_grad_norm_`` + torch's
  fused and foreach AdamW, per shape.
* ``memory.png`` (``memory``): each option's transient memory in one step, bytes per param.

A cell is ``median [min-max]``, a single number when they agree to two decimals; ``*`` marks a
cell whose values disagree by more than 15%, read as a range.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
from collections.abc import Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "images"
DISAGREEMENT = 0.15  # as cpu_step_ratios.py's
OURS_VARIANTS = "ours-"  # options of a case that are ours, not an alternative
CLIP_CASE = "clip"

Run = dict[str, Any]


def per_option(run: Run, key: str) -> dict[tuple[str, str, str], list[float]]:
    """``key`` of every (case, shape, option): one value per process (the median of its
    repetitions), or the repetitions of a single process."""
    runs = run["runs"]
    values: dict[tuple[str, str, str], list[float]] = {}
    for records in runs:
        for r in records:
            value = r[key]
            one = statistics.median(value) if isinstance(value, list) else value
            if len(runs) == 1 and isinstance(value, list):
                values[r["case"], r["shape"], r["option"]] = list(value)
            else:
                values.setdefault((r["case"], r["shape"], r["option"]), []).append(one)
    return values


def ours_of(run: Run) -> dict[str, str]:
    """Each case's own option (its first)."""
    first: dict[str, str] = {}
    for record in run["runs"][0]:
        first.setdefault(record["case"], record["option"])
    return first


def best_alternative_ratios(run: Run) -> dict[tuple[str, str], tuple[str, list[float]]]:
    """(case, shape) -> (the best alternative, ours / it for each process or repetition)."""
    seconds = per_option(run, "seconds")
    ours = ours_of(run)
    best = {}
    for case, shape in dict.fromkeys((c, s) for c, s, _ in seconds):
        alternatives = [
            o for c, s, o in seconds
            if (c, s) == (case, shape) and o != ours[case] and not o.startswith(OURS_VARIANTS)
        ]
        if not alternatives:
            continue
        fastest = min(alternatives, key=lambda o: statistics.median(seconds[case, shape, o]))
        mine, theirs = seconds[case, shape, ours[case]], seconds[case, shape, fastest]
        best[case, shape] = (fastest, [a / b for a, b in zip(mine, theirs)])
    return best


def cell(values: Iterable[float], digits: int = 2) -> str:
    """``median [min-max]``; ``*`` when they disagree by more than ``DISAGREEMENT``."""
    values = sorted(values)
    low, high, median = values[0], values[-1], statistics.median(values)
    text = f"{median:.{digits}f}"
    if f"{low:.{digits}f}" != f"{high:.{digits}f}":
        text += f" [{low:.{digits}f}-{high:.{digits}f}]"
    return text + ("*" if high > low * (1 + DISAGREEMENT) else "")


def measured(run: Run) -> str:
    """The line under each table: the command, the machine, the load and the time."""
    env = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in run["environment"]}
    load = [re.search(r"load average: ([\d.]+)", run["load"][k]).group(1) for k in ("start", "end")]
    return (
        f"Measured {env['date']} with `{run['command']}` ({len(run['runs'])} process(es)), "
        f"{env['CPU']}; {env['software'].split(';')[0]}; load average {load[0]} at the start, "
        f"{load[1]} at the end; {run['seconds'] / 60:.0f} min."
    )


# ---------------------------------------------------------------------------- tables
def ratios_table(run: Run) -> list[str]:
    best = best_alternative_ratios(run)
    shapes = run["shapes"]
    lines = [
        "| optimizer | " + " | ".join(shapes) + " | best alternative |",
        "|---|" + "---|" * len(shapes) + "---|",
    ]
    for case in dict.fromkeys(c for c, _ in best):
        names = dict.fromkeys(best[case, s][0] for s in shapes if (case, s) in best)
        cells = [cell(best[case, s][1]) if (case, s) in best else "" for s in shapes]
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {', '.join(names)} |")
    return lines


def clipping_table(run: Run) -> list[str]:
    seconds = per_option(run, "seconds")
    shapes = [s for s in run["shapes"] if any(k[:2] == (CLIP_CASE, s) for k in seconds)]
    options = dict.fromkeys(o for c, _, o in seconds if c == CLIP_CASE)
    lines = [
        "| ms per step | " + " | ".join(shapes) + " |",
        "|---|" + "---|" * len(shapes) + "",
    ]
    for option in options:
        cells = [cell([1e3 * t for t in seconds[CLIP_CASE, s, option]], 1) for s in shapes]
        lines.append(f"| {_label(option)} | " + " | ".join(cells) + " |")
    return lines


def memory_table(run: Run) -> list[str]:
    memory = per_option(run, "bytes_per_param")
    ours = ours_of(run)
    lines = ["| optimizer | ours | the alternatives |", "|---|---|---|"]
    for case in dict.fromkeys(c for c, _, _ in memory):
        spans = {o: _span(memory, case, o) for c, _, o in memory if c == case}
        others = ", ".join(f"{o} {v}" for o, v in spans.items() if o != ours[case])
        lines.append(f"| {case} | {spans[ours[case]]} | {others} |")
    return lines


def _span(memory: dict[tuple[str, str, str], list[float]], case: str, option: str) -> str:
    """The range of an option's bytes/param over shapes and processes, one decimal."""
    values = [v for (c, _, o), vs in memory.items() if (c, o) == (case, option) for v in vs]
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return low if low == high else f"{low}-{high}"


def _label(option: str) -> str:
    return option if option.startswith(("GS", "ours")) else f"{option} (ours)"


# ---------------------------------------------------------------------------- figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ratios_figure(run: Run):
    plt = _pyplot()
    best = best_alternative_ratios(run)
    cases = list(dict.fromkeys(c for c, _ in best))
    shapes = run["shapes"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        xs = [j + (i - (len(shapes) - 1) / 2) * width for j, c in enumerate(cases)]
        values = [best.get((c, shape), ("", [float("nan")]))[1] for c in cases]
        medians = [statistics.median(v) for v in values]
        errors = [[m - min(v) for m, v in zip(medians, values)],
                  [max(v) - m for m, v in zip(medians, values)]]
        ax.bar(xs, medians, width, yerr=errors, capsize=2, label=shape)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)))
    names = {c: dict.fromkeys(best[c, s][0] for s in shapes if (c, s) in best) for c in cases}
    ax.set_xticklabels(
        [f"{c}\nvs " + "\n".join(n.replace("GS+", "GS+\n", 1) for n in names[c]) for c in cases],
        fontsize=7,
    )
    ax.set_ylabel("ours / best alternative\n(step time; < 1: ours is faster)", fontsize=8)
    ax.legend(title="shape", fontsize=7, title_fontsize=7)
    ax.set_title("CPU step time against the best alternative (median, range over processes)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def clipping_figure(run: Run):
    plt = _pyplot()
    seconds = per_option(run, "seconds")
    shapes = [s for s in run["shapes"] if any(k[:2] == (CLIP_CASE, s) for k in seconds)]
    options = list(dict.fromkeys(o for c, _, o in seconds if c == CLIP_CASE))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(options)
    for i, option in enumerate(options):
        xs = [j + (i - (len(options) - 1) / 2) * width for j in range(len(shapes))]
        medians = [1e3 * statistics.median(seconds[CLIP_CASE, s, option]) for s in shapes]
        ax.bar(xs, medians, width, label=_label(option))
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, fontsize=8)
    ax.set_ylabel("ms per step (lower is better)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title("AdamW with global-norm clipping: one step, unscale and clip included",
                 fontsize=9)
    fig.tight_layout()
    return fig


def memory_figure(run: Run):
    plt = _pyplot()
    memory = per_option(run, "bytes_per_param")
    ours = ours_of(run)
    bars = list(dict.fromkeys((c, o) for c, _, o in memory))
    labels = [f"{case}: {_label(option)}" for case, option in bars]
    values = [
        max(v for (c, _, o), vs in memory.items() if (c, o) == bar for v in vs) for bar in bars
    ]
    fig, ax = plt.subplots(figsize=(8, 0.22 * len(bars) + 1.2))
    colors = ["tab:orange" if option == ours[case] or option.startswith(OURS_VARIANTS)
              else "tab:gray" for case, option in bars]
    drawn = ax.barh(labels, values, color=colors)
    ax.bar_label(drawn, labels=[f"{v:.1f}" for v in values], fontsize=7, padding=2)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("transient bytes per param in one step (the largest over shapes)", fontsize=8)
    ax.set_title("Memory a step allocates beyond what it holds (orange: ours)", fontsize=9)
    fig.tight_layout()
    return fig


FIGURES = {
    "ratios": ("cpu_step_ratios.png", ratios_figure, ratios_table),
    "clipping": ("clipping.png", clipping_figure, clipping_table),
    "memory": ("memory.png", memory_figure, memory_table),
}


def generated_section(name: str, run: Run) -> str:
    """What docs/performance.md holds between the markers of ``name``."""
    _, _, table = FIGURES[name]
    return "\n".join([*table(run), "", measured(run)])


def rewrite_page(page: str, run: Run) -> str:
    for name in FIGURES:
        start, end = f"<!-- generated: {name} -->", f"<!-- /generated: {name} -->"
        if start not in page or end not in page:
            raise SystemExit(f"{PAGE} has no {start} ... {end} block")
        before, rest = page.split(start, 1)
        page = before + start + "\n" + generated_section(name, run) + "\n" + end + rest.split(
            end, 1
        )[1]
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=pathlib.Path, help="a cpu_step_ratios.py --json file")
    parser.add_argument("--images", type=pathlib.Path, default=IMAGES)
    parser.add_argument("--page", type=pathlib.Path, default=PAGE)
    args = parser.parse_args(argv)
    run = json.loads(args.json.read_text())
    args.images.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    for image, figure, _ in FIGURES.values():
        fig = figure(run)
        fig.savefig(args.images / image, dpi=110)
        plt.close(fig)
    args.page.write_text(rewrite_page(args.page.read_text(), run))
    print(f"wrote {', '.join(i for i, _, _ in FIGURES.values())} into {args.images}, "
          f"and the tables of {args.page}")


if __name__ == "__main__":
    main()
