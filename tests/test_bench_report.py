"""The benchmark command (README, "Benchmarks") ends with one ratio table: it has a header, says
which way is better, and comes after pytest-benchmark's own tables and pytest's short summary.
benchmarks/cpu_step_ratios.py (docs/performance.md's table) prints each cell as median [min-max]
over fresh processes, or the range and why when they disagree by more than 15%."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from prerequisites import require_module

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The benchmarks time a clock of their own that only their work moves (and a nanosecond a read,
# as a real clock moves between reads): the ratios are the same at any load, where wall-clock
# medians of a few rounds of microseconds were not (a busy machine can swap them).
CLOCK = textwrap.dedent(
    """
    _now = [0.0]

    def clock():
        _now[0] += 1e-9
        return _now[0]

    def work(seconds):
        _now[0] += seconds
    """
)
BENCHMARKS = textwrap.dedent(
    """
    import pytest
    from fake_clock import work

    def test_torch_way(benchmark):
        benchmark.group = "sum"
        benchmark.extra_info["baseline"] = True
        benchmark(work, 4e-6)

    def test_our_way(benchmark):
        benchmark.group = "sum"
        benchmark(work, 1e-6)

    def test_needs_a_gpu():
        pytest.skip("no GPU")
    """
)


def test_the_ratio_table_comes_last_with_a_header_and_which_way_is_better(tmp_path) -> None:
    require_module("pytest_benchmark", "the benchmarks run with pytest-benchmark (bench extra)")
    shutil.copy(ROOT / "benchmarks" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sums.py").write_text(BENCHMARKS)
    (tmp_path / "fake_clock.py").write_text(CLOCK)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-p", "no:cacheprovider", "-ra",
         "--benchmark-max-time=0.005", "--benchmark-min-rounds=3",
         "--benchmark-timer=fake_clock.clock"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if "medians from this run" in line)
    assert lines[title].startswith("=")
    before = "\n".join(lines[:title])
    assert "benchmark 'sum': 2 tests" in before  # pytest-benchmark's table came first
    assert "short test summary info" in before and "SKIPPED" in before
    legend, header, rule, *rows, final = lines[title + 1 :]
    assert "lower is better" in legend and "/ its group's baseline" in legend
    assert header.split()[:2] == ["group", "case"] and "ratio" in header
    assert set(rule) == {"-"}
    assert len(rows) == 2 and all(row.startswith("sum ") for row in rows)
    ratios = {row.split()[1]: float(row.split()[3].rstrip("x")) for row in rows}
    assert ratios == {"*test_torch_way": 1.0, "test_our_way": 0.25}
    assert "2 passed, 1 skipped" in final  # only pytest's counts line follows the table


def cpu_step_ratios():
    """benchmarks/cpu_step_ratios.py as a module (it imports its neighbours in benchmarks/)."""
    require_module("pytest_benchmark", "the benchmarks' helpers import it (bench extra)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cpu_step_ratios
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return cpu_step_ratios


def test_a_cell_is_median_and_range_or_the_range_and_why_its_values_disagree() -> None:
    cell = cpu_step_ratios().cell
    assert cell([0.96, 0.96, 0.961]) == "0.96"
    assert cell([1.10, 1.00, 1.05]) == "1.05 [1.00-1.10]"
    assert cell([1.00, 1.15, 1.08]) == "1.08 [1.00-1.15]"  # 15% apart: still agreeing
    # Two groups: the medians either side of the gap.
    assert cell([1.79, 1.24, 1.24]) == "1.24-1.79 (bimodal: 1.24 / 1.79)"
    assert cell([7.3, 3.36, 7.6]) == "3.36-7.60 (bimodal: 3.36 / 7.45)"
    # Over 15% in all, but no gap that large between neighbours: a drift, every value shown.
    assert cell([1.00, 1.10, 1.20]) == "1.00-1.20 (spread: 1.00 / 1.10 / 1.20)"


def test_the_table_has_one_value_per_process_and_docs_layout() -> None:
    module = cpu_step_ratios()

    def run(ours: list[float], fused: list[float], memory: float) -> list[dict]:
        return [
            dict(case="AdamW", shape=shape, option=option, seconds=seconds, bytes_per_param=b)
            for shape in ("500x10k", "char-lm")
            for option, seconds, b in (("ours", ours, memory), ("GS+fused", fused, 0.0))
        ]

    # Three processes of two repetitions: each process counts once, by its median ratio.
    runs = [run([1.0, 1.0], [2.0, 2.0], 0.1), run([1.0, 1.0], [1.0, 1.25], 1.6),
            run([1.0, 3.0], [2.0, 2.0], 0.0)]
    header, rule, row = module.table(runs, ["500x10k", "char-lm"])
    assert header == "| optimizer | alternative | 500x10k | char-lm | ours B/param | alt. B/param |"
    assert rule == "|---|---|---|---|---|---|"
    # Per process: 0.5, median(1.0, 0.8) = 0.9, median(0.5, 1.5) = 1.0.
    assert row == (
        "| AdamW | GS+fused | 0.50-1.00 (bimodal: 0.50 / 0.95) | "
        "0.50-1.00 (bimodal: 0.50 / 0.95) | 0.0-1.6 | 0.0 |"
    )
    # One process: the values are its repetitions' ratios.
    (*_, row) = module.table(runs[:1], ["500x10k"])
    assert row == "| AdamW | GS+fused | 0.50 | 0.1 | 0.0 |"


def test_the_sr_case_has_a_row_of_nearest_over_fused_fp32() -> None:
    """bf16 AdamW rounding to nearest over GS + fused AdamW on fp32 params: a row of its own."""
    module = cpu_step_ratios()
    options = (("ours", [3.0], 0.5), ("ours-nearest", [1.5], 0.2), ("GS+fused-fp32", [1.0], 0.0))
    run = [
        dict(case="SR", shape="2000x1k", option=option, seconds=seconds, bytes_per_param=b)
        for option, seconds, b in options
    ]
    *_, over_nearest, over_fused, nearest_over_fused = module.table([run], ["2000x1k"])
    assert over_nearest == "| SR | ours-nearest | 2.00 | 0.5 | 0.2 |"
    assert over_fused == "| SR | GS+fused-fp32 | 3.00 | 0.5 | 0.0 |"
    assert nearest_over_fused == "| SR | GS+fused-fp32, for ours-nearest | 1.50 | 0.2 | 0.0 |"


def test_bad_counts_are_refused_with_the_fix(capsys) -> None:
    parse_args = cpu_step_ratios().parse_args
    for argv, message in (
        (["--processes", "0"], "--processes must be at least 1, got 0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--processes", "2", "--one-process"], "give one or the other"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--processes", "3"]).reps == 1 and parse_args([]).reps == 3


def test_fresh_processes_print_the_environment_the_load_and_every_cell(capfd) -> None:
    # The parent in this process, the two children it spawns as a user's run would.
    cpu_step_ratios().main(
        ["--processes", "2", "--cases", "SGD", "--shapes", "2000x1k", "--rounds", "2"]
    )
    out, err = capfd.readouterr()
    assert "torch " + torch.__version__ in out and "logical cores" in out
    assert out.count("load average:") == 4  # start, each process, end
    assert "over 2 fresh processes (1 repetition(s) each) of 2 rotated rounds" in out
    rows = [line for line in out.splitlines() if line.startswith("| SGD |")]
    assert [row.split(" | ")[1] for row in rows] == ["GS+fused", "GS+foreach"]
    assert err.count("SGD     2000x1k  ours") == 2  # each process measured it
