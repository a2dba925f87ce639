"""Prints, after a benchmark run, each case's time as a ratio of torch's measured in the same run:
one table, with a header that says which way is better, as the last thing the run prints (after
pytest-benchmark's own tables and pytest's short summary; only the final counts line follows)."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TITLE = "scaledoptim vs torch: ratios of medians from this run"
LEGEND = (
    "ratio = this case's median / its group's baseline (torch's way of doing the same thing, "
    "marked *): lower is better; a scaledoptim case below 1.00x is faster than torch's"
)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The outermost wrapper of the terminal summary: our table comes after every other
    plugin's summary (pytest-benchmark's tables) and after pytest's own."""
    result = yield
    lines = ratio_table(getattr(config, "_benchmarksession", None))
    if lines:
        terminalreporter.section(TITLE)
        for line in lines:
            terminalreporter.write_line(line)
    return result


def ratio_table(session) -> list[str]:
    """Each group's medians as ratios to its baseline: the benchmark that set
    ``benchmark.extra_info["baseline"] = True`` (torch's way of doing the same thing). Where a
    benchmark times ``extra_info["calls"]`` calls per round, the extra microseconds per call
    over the baseline are printed too, and where it set ``extra_info["target_s"]``, whether its
    median meets that target. Empty when nothing was benchmarked against a baseline."""
    if session is None or not session.benchmarks:
        return []
    groups: dict[str, list] = {}
    for bench in session.benchmarks:
        if bench.stats is not None:
            groups.setdefault(bench.group or "", []).append(bench)
    rows = []
    for group, benches in sorted(groups.items()):
        baseline = next((b for b in benches if b.extra_info.get("baseline")), None)
        if baseline is None:
            continue
        for bench in sorted(benches, key=lambda b: b.name):
            median, base = bench.stats.median, baseline.stats.median
            mark = "*" if bench is baseline else " "
            line = f"{group:<44} {mark}{bench.name:<60} {median * 1e3:9.3f} {median / base:7.3f}x"
            calls = bench.extra_info.get("calls")
            if calls:
                line += f"  {(median - base) / calls * 1e6:+7.2f} us/call"
            target = bench.extra_info.get("target_s")
            if target:
                line += f"  target {target * 1e3:.3f} ms: {'met' if median <= target else 'MISSED'}"
            rows.append(line)
    if not rows:
        return []
    header = f"{'group':<44} {'case (* = baseline)':<61} {'median ms':>9} {'ratio':>8}  extra"
    return [LEGEND, header, "-" * len(header), *rows]
