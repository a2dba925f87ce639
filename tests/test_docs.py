"""Every ```python block of every docs page runs as written, so the docs cannot rot."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [
    pytest.param(code, id=f"{page.relative_to(DOCS)}[{i}]")
    for page in sorted(DOCS.rglob("*.md"))
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


@pytest.mark.parametrize("code", BLOCKS)
def test_docs_code_block_runs(code: str, request) -> None:
    # dont_inherit: the block runs as a reader runs it, without this module's __future__ import
    # (postponed annotations would send a block's dataclass looking for a module "docs").
    exec(compile(code, request.node.callspec.id, "exec", dont_inherit=True), {"__name__": "docs"})


# Columns of a code block that a 1280 px wide page shows whole, with both sidebars of the
# site's theme (82 in headless Chromium's monospace font; 2 to spare for other fonts).
CODE_COLUMNS = 80


def test_docs_code_blocks_fit_a_1280_px_page() -> None:
    too_wide = [
        f"{page.relative_to(DOCS)}: {line}"
        for page in sorted(DOCS.rglob("*.md"))
        for block in re.findall(r"^ *```[^\n]*\n(.*?)^ *```", page.read_text(), flags=re.S | re.M)
        for line in block.splitlines()
        if len(line) > CODE_COLUMNS
    ]
    assert not too_wide, "code lines a 1280 px page cuts (wrap them):\n" + "\n".join(too_wide)


README = DOCS.parent / "README.md"


def test_the_readme_claims_table_names_tests_that_exist() -> None:
    table = README.read_text().split("## Claims and the tests that check them")[1].split("\n## ")[0]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table)
    assert len(named) >= 8, table
    for path, name in named:
        source = (DOCS.parent / path).read_text()
        assert re.search(rf"^def {name}\(", source, flags=re.M), f"{path} has no {name}"
    assert "`.ci/wheel_smoke.sh`" in table and (DOCS.parent / ".ci" / "wheel_smoke.sh").exists()


def test_the_readmes_first_python_block_runs_as_written() -> None:
    """The README's first example, on this (CPU-only) machine: the AdamW loop trains, with
    fp16 autocast on the CPU, and the LBFGS closure form steps."""
    first = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]
    namespace: dict = {"__name__": "readme"}
    exec(compile(first, "README.md", "exec"), namespace)
    assert namespace["device"] == "cpu"
    assert namespace["opt"].state and namespace["lbfgs"].state  # both stepped
    assert namespace["loss"].item() < 0.1  # trained: the targets' variance is about 1


def test_the_documentation_url_points_at_the_readmes_documentation_section() -> None:
    """Not at a page of the mkdocs source, which GitHub shows with its directives as text."""
    pyproject = (DOCS.parent / "pyproject.toml").read_text()
    url = re.search(r'^Documentation = "([^"]+)"', pyproject, flags=re.M).group(1)
    assert not url.endswith(".md"), url
    anchor = url.rsplit("#", 1)[1]
    assert re.search(rf"^## {anchor.capitalize()}$", README.read_text(), flags=re.M), url
