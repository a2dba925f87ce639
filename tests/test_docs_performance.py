"""docs/performance.md's figures and tables come from a benchmark run's JSON
(``benchmarks/plot_performance.py``): the tables on the page are the committed JSON's, every
figure the page and the README show is committed, and each is drawn from that JSON."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
from prerequisites import require_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cpu_step_ratios.json"


def _plotting():
    spec = importlib.util.spec_from_file_location(
        "plot_performance", ROOT / "benchmarks" / "plot_performance.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run() -> dict:
    return json.loads(RESULTS.read_text())


def test_the_pages_tables_are_the_committed_runs(run) -> None:
    plotting = _plotting()
    page = plotting.PAGE.read_text()
    assert len(plotting.FIGURES) >= 3
    for name in plotting.FIGURES:
        shown = page.split(f"<!-- generated: {name} -->\n")[1]
        shown = shown.split(f"\n<!-- /generated: {name}")[0]
        assert shown == plotting.generated_section(name, run), name
    assert plotting.rewrite_page(page, run) == page


def test_every_figure_is_committed_shown_and_drawn_from_the_run(run, tmp_path) -> None:
    require_module("matplotlib", "the figures are drawn with the plot extra")
    plotting = _plotting()
    page = plotting.PAGE.read_text()
    for image, figure, _ in plotting.FIGURES.values():
        assert (plotting.IMAGES / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
        assert f"](images/{image})" in page, image
        fig = figure(run)  # draws from the JSON without error, with something on it
        assert fig.axes and any(ax.has_data() for ax in fig.axes), image
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"\]\(docs/images/cpu_step_ratios\.png\)", readme)
