"""The benchmark command (README, "Benchmarks") ends with one ratio table: it has a header, says
which way is better, and comes after pytest-benchmark's own tables and pytest's short summary."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import textwrap

from prerequisites import require_module

ROOT = pathlib.Path(__file__).resolve().parents[1]

BENCHMARKS = textwrap.dedent(
    """
    import pytest

    def test_torch_way(benchmark):
        benchmark.group = "sum"
        benchmark.extra_info["baseline"] = True
        benchmark(lambda: sum(range(4000)))

    def test_our_way(benchmark):
        benchmark.group = "sum"
        benchmark(lambda: sum(range(1000)))

    def test_needs_a_gpu():
        pytest.skip("no GPU")
    """
)


def test_the_ratio_table_comes_last_with_a_header_and_which_way_is_better(tmp_path) -> None:
    require_module("pytest_benchmark", "the benchmarks run with pytest-benchmark (bench extra)")
    shutil.copy(ROOT / "benchmarks" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sums.py").write_text(BENCHMARKS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-p", "no:cacheprovider", "-ra",
         "--benchmark-max-time=0.005", "--benchmark-min-rounds=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
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
    assert ratios["*test_torch_way"] == 1.0 and ratios["test_our_way"] < 1.0
    assert "2 passed, 1 skipped" in final  # only pytest's counts line follows the table
