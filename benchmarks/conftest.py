"""Prints, after a benchmark run, each case's time as a ratio of torch's measured in the same run."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Each group's medians as ratios to its baseline: the benchmark that set
    ``benchmark.extra_info["baseline"] = True`` (torch's way of doing the same thing). Where a
    benchmark times ``extra_info["calls"]`` calls per round, the extra microseconds per call
    over the baseline are printed too, and where it set ``extra_info["target_s"]``, whether its
    median meets that target."""
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups: dict[str, list] = {}
    for bench in session.benchmarks:
        if bench.stats is not None:
            groups.setdefault(bench.group or "", []).append(bench)
    terminalreporter.section("ratios to torch, medians from this run")
    for group, benches in sorted(groups.items()):
        baseline = next((b for b in benches if b.extra_info.get("baseline")), None)
        if baseline is None:
            continue
        for bench in sorted(benches, key=lambda b: b.name):
            median, base = bench.stats.median, baseline.stats.median
            line = f"{group:<44} {bench.name:<60} {median * 1e3:9.3f} ms  {median / base:6.3f}x"
            calls = bench.extra_info.get("calls")
            if calls:
                line += f"  {(median - base) / calls * 1e6:+7.2f} us/call"
            target = bench.extra_info.get("target_s")
            if target:
                line += f"  target {target * 1e3:.3f} ms: {'met' if median <= target else 'MISSED'}"
            terminalreporter.write_line(line)
