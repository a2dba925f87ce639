"""Prints, after a benchmark run, each case's time as a ratio of torch's measured in the same run."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The group's baseline: GradScaler + torch's fused optimizer. Other torch cases in a group
# (foreach, unscaled) are comparisons, not the denominator.
BASELINE_MARK = "test_torch_gradscaler_fused"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups: dict[str, dict[str, float]] = {}
    for bench in session.benchmarks:
        if bench.stats is None:
            continue
        groups.setdefault(bench.group or "", {})[bench.name] = bench.stats.median
    terminalreporter.section("ratios to torch, medians from this run")
    for group, medians in sorted(groups.items()):
        baseline = [t for name, t in medians.items() if name.startswith(BASELINE_MARK)]
        if not baseline:
            continue
        for name, median in sorted(medians.items()):
            terminalreporter.write_line(
                f"{group:<28} {name:<60} {median * 1e3:9.3f} ms  {median / baseline[0]:6.3f}x"
            )
